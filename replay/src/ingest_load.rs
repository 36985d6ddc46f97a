//! The load generator behind `oomscope bench ingest`, for sizing a collector. N agent
//! streams each send M real-size samples (the allocator counters and host
//! readings of a shipped H200 capture, encoded as the agent's reporter
//! encodes them) as fast as acks allow, or paced as real agents send them,
//! and the figures are the collector's: every frame is encoded before the
//! clock starts.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use oomscope_agent_core::{now_ns, pb};
use prost::bytes::{Buf, BufMut};
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use pb::agent_message::Body;
use pb::collector_message::Body as Reply;

use crate::capture;

/// Agent streams a run opens unless told otherwise.
pub const DEFAULT_AGENTS: usize = 4;
/// Samples each stream sends unless told otherwise.
pub const DEFAULT_SAMPLES: usize = 10_000;
/// Unacked samples one stream may have in flight: the collector stores at
/// most 256 messages per transaction, so one batch in flight and one
/// arriving keep it busy without queueing acks behind seconds of backlog.
pub const DEFAULT_WINDOW: usize = 512;
/// How long the collector may leave a stream without an ack before the run
/// fails (it is stuck, not slow).
pub const ACK_TIMEOUT: Duration = Duration::from_secs(30);

/// The capture whose samples are sent: a real runtime (Hugging Face
/// transformers generating on an H200), with PyTorch's 122 allocator
/// counters and the process's host readings in every sample.
const CAPTURE: &[u8] = include_bytes!("../../tests/fixtures/torch-h200/hf_varied_no_leak.json.gz");
const CAPTURE_NAME: &str = "hf_varied_no_leak";
/// The agents' name at the collector.
pub const BENCH_AGENT_NAME: &str = "bench-ingest";
const CONNECT_PATH: &str = "/oomscope.v1.AgentService/Connect";

/// What one run measured (`--json` prints it as is).
#[derive(Clone, Debug, PartialEq)]
pub struct Figures {
    pub acked_samples_per_s: f64,
    pub p50_ack_ms: f64,
    pub p99_ack_ms: f64,
    /// None when the collector is not a process on this host.
    pub collector_cpu_us_per_sample: Option<f64>,
    pub agents: usize,
    pub samples: usize,
    /// Mean bytes of a sample message on the wire.
    pub wire_bytes_per_sample: f64,
    /// Paced: how late the generator itself sent its samples (p99, ms after
    /// each was due; None unpaced). A late send counts in the ack latency
    /// (measured from when the sample was due) but is the generator's, not
    /// the collector's: one thread drives every stream.
    pub p99_send_late_ms: Option<f64>,
    /// This generator's own CPU per acked sample: it shares the host with
    /// the collector it measures.
    pub generator_cpu_us_per_sample: Option<f64>,
}

/// The load one run puts on a collector.
#[derive(Clone, Copy, Debug)]
pub struct Load {
    pub agents: usize,
    /// Samples per agent stream.
    pub samples: usize,
    /// Unacked samples one stream may have in flight.
    pub window: usize,
    /// Every sample's counters complete, as agents without delta encoding
    /// send them.
    pub complete_counters: bool,
    /// Samples per second each stream sends, paced as an agent's sampler
    /// sends them (the streams' starts spread over one interval); None: as
    /// fast as acks allow. Paced, a sample's ack latency counts from when it
    /// was due, so a window that holds it back shows in the figures.
    pub rate: Option<f64>,
}

/// Puts `load` on the collector at `collector_url` and measures it; blocks
/// until every sample is acked (an error if one stream goes unacked for
/// [`ACK_TIMEOUT`]).
pub fn measure(collector_url: &str, load: Load) -> Result<Figures> {
    if load.agents == 0 || load.samples == 0 || load.window == 0 {
        bail!("--agents, --samples and --window must each be at least 1");
    }
    if load.rate.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
        bail!("--rate must be a positive number of samples per second");
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(run(collector_url, load))
}

/// A message encoded before the clock starts: its bytes go on the stream as
/// they are (a message's encoding is the concatenation of its fields, so
/// writing them raw is writing the message).
#[derive(Clone, Debug, Default)]
struct PreEncoded(prost::bytes::Bytes);

impl Message for PreEncoded {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.0);
    }
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: prost::encoding::WireType,
        buf: &mut impl Buf,
        ctx: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        // Only ever sent, never decoded.
        prost::encoding::skip_field(wire_type, tag, buf, ctx)
    }
    fn encoded_len(&self) -> usize {
        self.0.len()
    }
    fn clear(&mut self) {
        self.0.clear();
    }
}

/// One agent's stream, encoded: the Hello, M samples, the Goodbye.
struct Frames {
    hello: PreEncoded,
    samples: Vec<PreEncoded>,
    goodbye: PreEncoded,
}

/// The capture's samples that carry allocator counters, in order.
fn capture_samples(base_ns: i64) -> Result<Vec<pb::Sample>> {
    let cap = capture::parse(CAPTURE, CAPTURE_NAME, base_ns)?;
    let samples: Vec<pb::Sample> = cap
        .samples()
        .filter(|s| !s.allocator.is_empty())
        .cloned()
        .collect();
    if samples.is_empty() {
        bail!("the built-in capture {CAPTURE_NAME} has no allocator samples");
    }
    Ok(samples)
}

/// Agent `index`'s stream: the capture's samples over and over, a
/// millisecond apart, numbered from seq 1.
fn frames(agent_id: &str, source: &[pb::Sample], load: Load, base_ns: i64) -> Frames {
    let hello = pb::Hello {
        agent_id: agent_id.to_string(),
        name: BENCH_AGENT_NAME.to_string(),
        host: "oomscope-bench".to_string(),
        role: oomscope_proto::Role::Bench.into(),
        runtime: "pytorch".to_string(),
        start_time_ns: base_ns,
        ..Default::default()
    };
    let encode = |seq: u64, body: Body| {
        PreEncoded(
            pb::AgentMessage {
                seq,
                body: Some(body),
            }
            .encode_to_vec()
            .into(),
        )
    };
    // As the reporter puts them on a stream: counters as changes where smaller.
    let mut delta = oomscope_proto::delta::Encoder::new();
    let encoded = (0..load.samples)
        .map(|i| {
            let mut sample = source[i % source.len()].clone();
            sample.time_ns = base_ns + i as i64 * 1_000_000;
            let mut message = pb::AgentMessage {
                seq: i as u64 + 1,
                body: Some(Body::Sample(sample)),
            };
            if !load.complete_counters {
                message = delta.encode(message);
            }
            PreEncoded(message.encode_to_vec().into())
        })
        .collect();
    Frames {
        hello: encode(0, Body::Hello(hello)),
        samples: encoded,
        goodbye: encode(
            load.samples as u64 + 1,
            Body::Goodbye(pb::Goodbye {
                reason: "bench finished".into(),
                exit_code: 0,
            }),
        ),
    }
}

/// An open stream, its Hello sent.
struct Stream {
    out: mpsc::Sender<PreEncoded>,
    inbound: tonic::Streaming<pb::CollectorMessage>,
}

async fn open(endpoint: &Endpoint, hello: PreEncoded, window: usize) -> Result<Stream> {
    let channel: Channel = endpoint.connect().await?;
    // Room for the whole window and the Goodbye: sending never waits on the
    // channel, only on the window.
    let (out, rx) = mpsc::channel(window + 2);
    out.try_send(hello)
        .map_err(|_| anyhow!("queueing the Hello"))?;
    let mut grpc = tonic::client::Grpc::new(channel)
        .max_encoding_message_size(oomscope_proto::MAX_MESSAGE_BYTES)
        .max_decoding_message_size(oomscope_proto::MAX_MESSAGE_BYTES);
    grpc.ready().await.map_err(|e| anyhow!("{e}"))?;
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    oomscope_proto::bearer::Bearer::from_env()
        .map_err(|e| anyhow!(e))?
        .stamp(&mut request);
    let response = grpc
        .streaming(
            request,
            tonic::codegen::http::uri::PathAndQuery::from_static(CONNECT_PATH),
            tonic_prost::ProstCodec::<PreEncoded, pb::CollectorMessage>::default(),
        )
        .await?;
    Ok(Stream {
        out,
        inbound: response.into_inner(),
    })
}

/// When a paced stream's samples are due: sample `i` (from 0) at `first +
/// i / rate`.
#[derive(Clone, Copy)]
struct Pace {
    first: Instant,
    interval: Duration,
}

impl Pace {
    fn due(&self, i: usize) -> Instant {
        self.first + self.interval.mul_f64(i as f64)
    }
}

/// What one stream measured: each sample's ack latency and, paced, how late
/// each was sent.
#[derive(Default)]
struct Timings {
    acks: Vec<Duration>,
    late: Vec<Duration>,
}

/// Sends every sample with at most `window` unacked (and, with `pace`, none
/// before it is due), then the Goodbye, and returns each sample's ack
/// latency (and, paced, its send lateness).
async fn drive(
    mut stream: Stream,
    frames: Vec<PreEncoded>,
    goodbye: PreEncoded,
    window: usize,
    pace: Option<Pace>,
) -> Result<Timings> {
    let total = frames.len();
    let mut sent_at: Vec<Option<Instant>> = vec![None; total + 1];
    let mut latencies = Vec::with_capacity(total);
    let mut late = Vec::with_capacity(if pace.is_some() { total } else { 0 });
    let mut frames = frames.into_iter();
    let (mut next, mut acked) = (0usize, 0usize);
    let goodbye_seq = total as u64 + 1;
    let mut goodbye_acked = false;
    let mut goodbye = Some(goodbye);
    while !goodbye_acked {
        while next < total && next - acked < window {
            let due = pace.map(|p| p.due(next));
            if due.is_some_and(|d| d > Instant::now()) {
                break;
            }
            let frame = frames.next().expect("one frame per sample");
            stream
                .out
                .try_send(frame)
                .map_err(|_| anyhow!("the stream closed"))?;
            next += 1;
            let now = Instant::now();
            if let Some(due) = due {
                late.push(now - due);
            }
            sent_at[next] = Some(due.unwrap_or(now));
        }
        if acked == total {
            if let Some(g) = goodbye.take() {
                stream
                    .out
                    .try_send(g)
                    .map_err(|_| anyhow!("the stream closed"))?;
            }
        }
        // The next paced sample, if only its time holds it back.
        let due = pace
            .filter(|_| next < total && next - acked < window)
            .map(|p| p.due(next));
        let reply = tokio::select! {
            reply = tokio::time::timeout(ACK_TIMEOUT, stream.inbound.message()) => reply,
            _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now).into()), if due.is_some() => continue,
        };
        let reply = reply.map_err(|_| anyhow!("no ack for {} s", ACK_TIMEOUT.as_secs()))??;
        let now = Instant::now();
        match reply.and_then(|r| r.body) {
            Some(Reply::Ack(a)) => {
                for seq in a.from_seq..=a.to_seq {
                    if seq == goodbye_seq {
                        goodbye_acked = true;
                    }
                    let Some(at) = usize::try_from(seq)
                        .ok()
                        .and_then(|s| sent_at.get_mut(s))
                        .and_then(Option::take)
                    else {
                        continue;
                    };
                    latencies.push(now - at);
                    acked += 1;
                }
            }
            Some(Reply::Reject(r)) => bail!("the collector rejected seq {}: {}", r.seq, r.reason),
            Some(Reply::Directive(_)) | None => {}
        }
    }
    Ok(Timings {
        acks: latencies,
        late,
    })
}

async fn run(url: &str, load: Load) -> Result<Figures> {
    let Load {
        agents,
        samples,
        window,
        ..
    } = load;
    let endpoint = Endpoint::from_shared(url.to_string())
        .with_context(|| format!("`{url}` is not a collector URL"))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(3));
    let endpoint = oomscope_proto::tls::secure(endpoint, url).map_err(|e| anyhow!(e))?;
    let base_ns = now_ns();
    let source = capture_samples(base_ns)?;
    let mut all = Vec::with_capacity(agents);
    for i in 0..agents {
        let id = format!("bench-{:x}-{}-{i}", base_ns, std::process::id());
        all.push(frames(&id, &source, load, base_ns));
    }
    let wire: usize = all
        .iter()
        .flat_map(|f| f.samples.iter().map(|s| s.0.len()))
        .sum();
    let mut streams = Vec::with_capacity(agents);
    for f in &all {
        let s = open(&endpoint, f.hello.clone(), window)
            .await
            .with_context(|| format!("opening a stream to the collector at {url}"))?;
        streams.push(s);
    }
    let pid = collector_pid(&endpoint);
    let cpu_before = pid.and_then(cpu_time);
    let started = Instant::now();
    let tasks: Vec<_> = streams
        .into_iter()
        .zip(all)
        .enumerate()
        .map(|(i, (s, f))| {
            // Stream i starts i/agents of an interval in, as agents started
            // at different times would.
            let pace = load.rate.map(|rate| {
                let interval = Duration::from_secs_f64(1.0 / rate);
                Pace {
                    first: started + interval.mul_f64(i as f64 / agents as f64),
                    interval,
                }
            });
            tokio::spawn(drive(s, f.samples, f.goodbye, window, pace))
        })
        .collect();
    let own_cpu_before = cpu_time(std::process::id());
    let mut latencies = Vec::with_capacity(agents * samples);
    let mut late = Vec::new();
    for t in tasks {
        let timings = t
            .await
            .map_err(|e| anyhow!("an agent task failed: {e}"))??;
        latencies.extend(timings.acks);
        late.extend(timings.late);
    }
    let elapsed = started.elapsed();
    let cpu_after = pid.and_then(cpu_time);
    let own_cpu_after = cpu_time(std::process::id());
    let total = latencies.len();
    if total != agents * samples {
        bail!("{total} of {} samples acked", agents * samples);
    }
    let ms: Vec<f64> = latencies.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    let quantile = |q| oomscope_analysis::stats::quantile(&ms, q).unwrap_or(0.0);
    let late_ms: Vec<f64> = late.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    let per_sample = |before: Option<Duration>, after: Option<Duration>| {
        before
            .zip(after)
            .map(|(b, a)| a.saturating_sub(b).as_secs_f64() * 1e6 / total as f64)
    };
    Ok(Figures {
        acked_samples_per_s: total as f64 / elapsed.as_secs_f64(),
        p50_ack_ms: quantile(0.5),
        p99_ack_ms: quantile(0.99),
        collector_cpu_us_per_sample: per_sample(cpu_before, cpu_after),
        agents,
        samples,
        wire_bytes_per_sample: wire as f64 / total as f64,
        p99_send_late_ms: load
            .rate
            .and_then(|_| oomscope_analysis::stats::quantile(&late_ms, 0.99)),
        generator_cpu_us_per_sample: per_sample(own_cpu_before, own_cpu_after),
    })
}

/// The pid of the process on this host that listens where `endpoint`
/// points: the listening socket's inode from /proc/net/tcp{,6}, then the
/// process holding it among /proc/*/fd. None for a remote collector.
fn collector_pid(endpoint: &Endpoint) -> Option<u32> {
    let uri = endpoint.uri();
    let port = uri.port_u16().unwrap_or(80);
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    let targets: Vec<IpAddr> = (host, port)
        .to_socket_addrs()
        .ok()?
        .map(|a: SocketAddr| a.ip())
        .collect();
    let inodes = listening_inodes(port, &targets);
    if inodes.is_empty() {
        return None;
    }
    socket_owner(&inodes)
}

/// Inodes of LISTEN sockets on `port` that a connection to one of `targets`
/// reaches: the same address, or a wildcard one when the target is loopback.
fn listening_inodes(port: u16, targets: &[IpAddr]) -> Vec<u64> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st ... inode (10th column)
            let (Some(local), Some(state), Some(inode)) = (f.get(1), f.get(3), f.get(9)) else {
                continue;
            };
            if *state != "0A" {
                continue;
            }
            let Some((ip, p)) = parse_proc_addr(local) else {
                continue;
            };
            let reached = targets.iter().any(|t| {
                *t == ip || (ip.is_unspecified() && t.is_loopback()) || ip.to_canonical() == *t
            });
            if p == port && reached {
                inodes.extend(inode.parse::<u64>().ok());
            }
        }
    }
    inodes
}

/// "0100007F:1D09" (IPv4) or the 32-hex-digit IPv6 form, as the kernel
/// writes them: each 32-bit word in host (little-endian) order.
fn parse_proc_addr(s: &str) -> Option<(IpAddr, u16)> {
    let (addr, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let words: Vec<u32> = (0..addr.len() / 8)
        .map(|i| u32::from_str_radix(&addr[i * 8..i * 8 + 8], 16))
        .collect::<Result<_, _>>()
        .ok()?;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let ip = match bytes.len() {
        4 => IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
        _ => return None,
    };
    Some((ip, port))
}

/// The process with an fd on one of the sockets `inodes`.
fn socket_owner(inodes: &[u64]) -> Option<u32> {
    let wanted: HashMap<String, ()> = inodes
        .iter()
        .map(|i| (format!("socket:[{i}]"), ()))
        .collect();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(link) = std::fs::read_link(fd.path()) {
                if wanted.contains_key(link.to_string_lossy().as_ref()) {
                    return Some(pid);
                }
            }
        }
    }
    None
}

/// A process's user + system CPU time so far, from /proc/PID/stat.
fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command may hold spaces and parentheses: fields start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat, 12 and 13 here.
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (per_s > 0).then(|| Duration::from_secs_f64(ticks as f64 / per_s as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_addresses_parse_in_host_order() {
        assert_eq!(
            parse_proc_addr("0100007F:1D09"),
            Some((IpAddr::from([127, 0, 0, 1]), 7433))
        );
        assert_eq!(
            parse_proc_addr("00000000000000000000000001000000:0050"),
            Some(("::1".parse().unwrap(), 80))
        );
        assert_eq!(parse_proc_addr("zz:1"), None);
    }

    #[test]
    fn frames_number_samples_from_one_and_end_with_goodbye() {
        let source = capture_samples(1).unwrap();
        let load = Load {
            agents: 1,
            samples: 3,
            window: 1,
            complete_counters: false,
            rate: None,
        };
        let f = frames("a", &source, load, 1);
        let seqs: Vec<u64> = f
            .samples
            .iter()
            .map(|p| pb::AgentMessage::decode(p.0.clone()).unwrap().seq)
            .collect();
        assert_eq!(seqs, vec![1, 2, 3]);
        let bye = pb::AgentMessage::decode(f.goodbye.0.clone()).unwrap();
        assert_eq!(bye.seq, 4);
        assert!(matches!(bye.body, Some(Body::Goodbye(_))));
        assert!(source[0].allocator[0].raw.len() > 100);
    }
}
