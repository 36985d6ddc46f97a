//! One sampling loop for every agent: a clock that samples every interval
//! (and skips, rather than bursts, when it falls behind), the collector's
//! directives, jobs handed over by the request path, and a clean stop. The
//! agent plugs in what it reads through [`Readers`].

use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::interval::check_interval;
use crate::pb;
use crate::reporter::Reporter;
use crate::sync::lock;

/// What the request path hands to the sampling thread.
pub enum Control<J> {
    Job(J),
    /// Flush what waits and end the loop.
    Stop,
}

/// Whether the loop goes on after a poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

/// What one agent reads and does on the sampling thread. Only `tick` is
/// required; the rest default to nothing.
pub trait Readers {
    /// Work the request path hands over (boundary samples, censuses).
    type Job;

    /// The periodic reading: host domains and whatever this agent adds.
    fn tick(&mut self, reporter: &Reporter);

    /// A job from the request path.
    fn job(&mut self, _job: Self::Job, _reporter: &Reporter) {}

    /// A directive other than `SetSampleInterval`, which the loop applies
    /// itself under the one interval rule.
    fn directive(&mut self, d: pb::Directive, _reporter: &Reporter) {
        tracing::debug!(directive = ?d.kind, "directive not applicable to this agent; ignored");
    }

    /// Runs on every pass of the loop, before it waits: work that became
    /// due, or the end of what is watched ([`Flow::Stop`]).
    fn poll(&mut self, _reporter: &Reporter) -> Flow {
        Flow::Continue
    }

    /// When the loop must wake besides its clock (work waiting for a moment).
    fn next_wake(&self) -> Option<Instant> {
        None
    }

    /// The loop is ending on a Stop: send what still waits.
    fn stop(&mut self, _reporter: &Reporter) {}
}

/// The loop's state: the interval (changed only by directives that pass the
/// rule) and where directives come from. It outlives one run, so a
/// supervisor that restarts its child keeps the interval it was told.
pub struct SamplingLoop<'a> {
    reporter: &'a Reporter,
    directives: Option<&'a Receiver<pb::Directive>>,
    interval: Duration,
    /// The process title as last seen.
    title: Option<String>,
}

impl<'a> SamplingLoop<'a> {
    pub fn new(
        reporter: &'a Reporter,
        directives: Option<&'a Receiver<pb::Directive>>,
        interval: Duration,
    ) -> Self {
        SamplingLoop {
            reporter,
            directives,
            interval,
            title: None,
        }
    }

    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Samples now and then every interval until a Stop arrives on `jobs`
    /// (or every sender is gone), or `readers.poll` says stop. Without
    /// `jobs`, only a poll ends it.
    pub fn run<R: Readers>(&mut self, readers: &mut R, jobs: Option<&Receiver<Control<R::Job>>>) {
        let mut next_tick = Instant::now();
        loop {
            if readers.poll(self.reporter) == Flow::Stop {
                return;
            }
            let now = Instant::now();
            if now >= next_tick {
                readers.tick(self.reporter);
                self.refresh_title();
                next_tick += self.interval;
                let after = Instant::now();
                if next_tick < after {
                    next_tick = after + self.interval; // fell behind: do not burst
                }
                self.apply_directives(readers);
                continue;
            }
            let wake = readers.next_wake().map_or(next_tick, |w| w.min(next_tick));
            let timeout = wake.saturating_duration_since(now);
            match jobs {
                Some(rx) => match rx.recv_timeout(timeout) {
                    Ok(Control::Job(j)) => readers.job(j, self.reporter),
                    Ok(Control::Stop) | Err(RecvTimeoutError::Disconnected) => {
                        readers.stop(self.reporter);
                        return;
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                },
                None => std::thread::sleep(timeout),
            }
        }
    }

    /// A runtime renames its processes after they start (vLLM's
    /// `VLLM::Worker`): the Hello follows, since the kernel's OOM record
    /// names the victim by this title.
    fn refresh_title(&mut self) {
        let Ok(comm) = std::fs::read_to_string("/proc/self/comm") else {
            return;
        };
        let comm = comm.trim_end();
        if self.title.as_deref() != Some(comm) {
            self.reporter.update_hello(|h| h.title = comm.to_string());
            self.title = Some(comm.to_string());
        }
    }

    fn apply_directives<R: Readers>(&mut self, readers: &mut R) {
        let Some(rx) = self.directives else { return };
        while let Ok(d) = rx.try_recv() {
            match d.kind {
                Some(pb::directive::Kind::SetSampleInterval(s)) => {
                    match check_interval(Duration::from_millis(s.interval_ms)) {
                        Ok(i) => {
                            self.interval = i;
                            tracing::info!(
                                interval_ms = s.interval_ms,
                                "sample interval changed by the collector"
                            );
                        }
                        Err(e) => {
                            tracing::warn!("the collector's interval directive was ignored: {e}")
                        }
                    }
                }
                _ => readers.directive(d, self.reporter),
            }
        }
    }
}

/// A sampling loop on its own thread ("oomscope-sampler", scheduled as
/// the reporter's is), and the bounded
/// queue the request path feeds it through: a full queue drops the job
/// (`submit` says so) rather than blocking a request.
pub struct Sampler<J> {
    tx: SyncSender<Control<J>>,
    rx: Mutex<Option<Receiver<Control<J>>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl<J: Send + 'static> Sampler<J> {
    /// A sampler whose queue holds `queue` jobs; nothing runs until `start`.
    pub fn new(queue: usize) -> Self {
        let (tx, rx) = sync_channel(queue);
        Sampler {
            tx,
            rx: Mutex::new(Some(rx)),
            thread: Mutex::new(None),
        }
    }

    /// Starts the loop with `readers`. False when it was already started, or
    /// no thread could be made (the agent then sends only what the request
    /// path sends itself).
    pub fn start<R>(&self, mut readers: R, reporter: Reporter, interval: Duration) -> bool
    where
        R: Readers<Job = J> + Send + 'static,
    {
        let Some(rx) = lock(&self.rx).take() else {
            return false;
        };
        let directives = reporter.directives();
        let priority = reporter.thread_priority();
        let spawned = std::thread::Builder::new()
            .name("oomscope-sampler".into())
            .spawn(move || {
                priority.apply_to_this_thread();
                SamplingLoop::new(&reporter, directives.as_ref(), interval)
                    .run(&mut readers, Some(&rx));
            });
        match spawned {
            Ok(h) => {
                *lock(&self.thread) = Some(h);
                true
            }
            Err(e) => {
                tracing::error!(error = %e, "oomscope: cannot start the sampler thread");
                false
            }
        }
    }

    /// Hands a job over without blocking; false when the queue is full or
    /// the loop has ended.
    pub fn submit(&self, job: J) -> bool {
        match self.tx.try_send(Control::Job(job)) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => false,
        }
    }

    /// Ends the loop (after the jobs queued before) and waits for it.
    /// Blocks only while the queue is full, which the loop drains.
    pub fn stop(&self) {
        let Some(h) = lock(&self.thread).take() else {
            return;
        };
        let _ = self.tx.send(Control::Stop);
        let _ = h.join();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{mpsc, Arc};

    use super::*;
    use crate::reporter::ReporterConfig;

    /// A reporter aimed at a port nothing listens on: sends queue in memory.
    fn offline_reporter() -> Reporter {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        Reporter::start(
            ReporterConfig::new(url),
            pb::Hello {
                agent_id: "sampling-test".into(),
                ..Default::default()
            },
        )
    }

    #[derive(Default)]
    struct Counting {
        ticks: Arc<AtomicUsize>,
        jobs: Vec<u32>,
        stopped: bool,
        stop_after_ticks: Option<usize>,
    }

    impl Readers for Counting {
        type Job = u32;
        fn tick(&mut self, _: &Reporter) {
            self.ticks.fetch_add(1, Ordering::SeqCst);
        }
        fn job(&mut self, job: u32, _: &Reporter) {
            self.jobs.push(job);
        }
        fn poll(&mut self, _: &Reporter) -> Flow {
            match self.stop_after_ticks {
                Some(n) if self.ticks.load(Ordering::SeqCst) >= n => Flow::Stop,
                _ => Flow::Continue,
            }
        }
        fn stop(&mut self, _: &Reporter) {
            self.stopped = true;
        }
    }

    #[test]
    fn a_poll_ends_the_loop_and_the_first_tick_is_at_once() {
        let reporter = offline_reporter();
        let mut r = Counting {
            stop_after_ticks: Some(3),
            ..Default::default()
        };
        let t = Instant::now();
        SamplingLoop::new(&reporter, None, Duration::from_millis(10)).run(&mut r, None);
        assert_eq!(r.ticks.load(Ordering::SeqCst), 3);
        // Ticks at 0, 10 and 20 ms: not a fourth interval's wait.
        assert!(
            t.elapsed() >= Duration::from_millis(20),
            "{:?}",
            t.elapsed()
        );
        assert!(
            !r.stopped,
            "a poll's stop is the readers' own: no stop() call"
        );
    }

    #[test]
    fn jobs_run_in_order_and_stop_flushes() {
        let reporter = offline_reporter();
        let (tx, rx) = mpsc::sync_channel(8);
        for j in [1, 2, 3] {
            tx.send(Control::Job(j)).unwrap();
        }
        tx.send(Control::Stop).unwrap();
        let mut r = Counting::default();
        SamplingLoop::new(&reporter, None, Duration::from_secs(3600)).run(&mut r, Some(&rx));
        assert_eq!(r.jobs, [1, 2, 3]);
        assert!(r.stopped);
        assert_eq!(
            r.ticks.load(Ordering::SeqCst),
            1,
            "one tick at start, none after"
        );
    }

    #[test]
    fn a_sampler_thread_ticks_takes_jobs_and_stops() {
        let reporter = offline_reporter();
        let ticks = Arc::new(AtomicUsize::new(0));
        let s: Sampler<u32> = Sampler::new(2);
        let r = Counting {
            ticks: ticks.clone(),
            ..Default::default()
        };
        assert!(s.start(r, reporter.clone(), Duration::from_millis(10)));
        assert!(!s.start(Counting::default(), reporter, Duration::from_millis(10)));
        std::thread::sleep(Duration::from_millis(60));
        assert!(s.submit(7));
        s.stop();
        assert!(ticks.load(Ordering::SeqCst) >= 2);
        assert!(!s.submit(8), "a stopped sampler takes no job");
    }

    #[test]
    fn only_an_interval_that_passes_the_rule_changes_the_interval() {
        let reporter = offline_reporter();
        let (tx, rx) = mpsc::channel();
        let mut l = SamplingLoop::new(&reporter, Some(&rx), Duration::from_millis(250));
        let set = |ms| pb::Directive {
            kind: Some(pb::directive::Kind::SetSampleInterval(
                pb::SetSampleInterval { interval_ms: ms },
            )),
        };
        let mut r = Counting::default();
        tx.send(set(0)).unwrap();
        tx.send(set(5)).unwrap();
        l.apply_directives(&mut r);
        assert_eq!(l.interval(), Duration::from_millis(250));
        tx.send(set(1000)).unwrap();
        l.apply_directives(&mut r);
        assert_eq!(l.interval(), Duration::from_secs(1));
    }
}
