//! A bounded on-disk spool of messages the collector has not acked yet.
//!
//! Layout: one directory per agent id under the spool root, holding
//! append-only segment files `seg-<n>.log`, a `state` file with the ack
//! floor, an `origin` file (the agent's Hello and collector, so that another
//! process can deliver what a dead agent left: see `crate::recovery`), and
//! a `lock` file. A segment starts with [`SEGMENT_MAGIC`] and holds
//! records `[b"OSR1"][len: u32 LE][crc32(payload): u32 LE][payload]`, where the
//! payload is an encoded `AgentMessage`. The record marker lets a reader find
//! the next good record after a damaged one, so one torn write (a crash
//! mid-append, a full disk) never hides the records after it.
//!
//! Each open starts a fresh segment instead of appending to an old one: a
//! previous run may have died mid-record, and its file stays as it was.
//! Disk use is bounded: past `max_bytes` the oldest segment is deleted and
//! its unacked records are counted as dropped.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use prost::Message;

use crate::pb;

/// The first bytes of every segment file.
pub const SEGMENT_MAGIC: &[u8; 8] = b"OOMSPL1\n";
/// The first bytes of every record, used to resynchronise after damage.
const RECORD_MAGIC: &[u8; 4] = b"OSR1";
const RECORD_HEADER_BYTES: usize = 12;
const STATE_MAGIC: &[u8; 4] = b"OSA1";
const STATE_FILE: &str = "state";
const LOCK_FILE: &str = "lock";
const ORIGIN_MAGIC: &[u8; 4] = b"OSO1";
const ORIGIN_FILE: &str = "origin";

/// Default disk bound per agent: at a few KiB per sample this is hours of
/// samples, and small next to the model files on the same machine.
pub const DEFAULT_SPOOL_MAX_BYTES: u64 = 64 * 1024 * 1024;
/// Segments are sized to an eighth of the bound (between these limits), so
/// dropping the oldest segment frees a predictable share and acked data is
/// reclaimed soon after the ack.
const MIN_SEGMENT_BYTES: u64 = 16 * 1024;
const MAX_SEGMENT_BYTES: u64 = 4 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    #[error("spool {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("spool {path} is already open in another reporter (lock held)")]
    Locked { path: PathBuf },
    #[error("message seq {seq} encodes to {bytes} bytes, more than the largest accepted message ({max})")]
    TooLarge { seq: u64, bytes: usize, max: usize },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> SpoolError + '_ {
    move |source| SpoolError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Something unreadable found in the spool: reported, skipped, never fatal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpoolProblem {
    pub path: PathBuf,
    pub offset: u64,
    pub reason: String,
}

impl std::fmt::Display for SpoolProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} at byte {}: {}",
            self.path.display(),
            self.offset,
            self.reason
        )
    }
}

/// What a full read of the spool found.
#[derive(Debug, Default)]
pub struct SpoolScan {
    /// Unacked messages, in seq order, each seq once.
    pub messages: Vec<pb::AgentMessage>,
    /// Damaged records and foreign files, skipped.
    pub problems: Vec<SpoolProblem>,
}

/// Counters since this spool was opened.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SpoolStats {
    pub appended: u64,
    /// Unacked records deleted because the spool was over `max_bytes`.
    pub dropped_records: u64,
    pub dropped_bytes: u64,
    /// Damaged records or foreign files met while reading.
    pub problems: u64,
    /// Bytes on disk in segment files now.
    pub bytes: u64,
    pub segments: usize,
}

#[derive(Debug)]
struct Segment {
    number: u64,
    path: PathBuf,
    bytes: u64,
    /// The seqs of the good records in it, to tell when it is fully acked
    /// and which seqs are lost if it has to be dropped.
    seqs: Vec<u64>,
}

impl Segment {
    fn max_seq(&self) -> u64 {
        self.seqs.iter().copied().max().unwrap_or(0)
    }
}

/// The spool of one agent id. Appends and acks come from one owner at a
/// time (the reporter wraps it in a `Mutex`); a lock file stops a second
/// process, or a second reporter, from opening the same agent's spool.
#[derive(Debug)]
pub struct Spool {
    dir: PathBuf,
    max_bytes: u64,
    segment_bytes: u64,
    segments: Vec<Segment>,
    /// The open segment, when this run has appended since its last rollover.
    current: Option<File>,
    /// Every seq at or below is acked (or was given up on).
    floor: u64,
    /// The highest seq ever appended, kept across runs so seqs never repeat.
    high: u64,
    /// (floor, high) as the state file holds them; None when it is missing
    /// or damaged. Closing rewrites the file only when they differ, so
    /// opening a settled spool (every recovery pass does) writes nothing.
    saved: Option<(u64, u64)>,
    stats: SpoolStats,
    _lock: File,
}

/// Who wrote a spool: enough for another process to resend it as that agent.
#[derive(Debug, Clone, PartialEq)]
pub struct Origin {
    pub collector_url: String,
    pub hello: pb::Hello,
}

impl Spool {
    /// Opens (creating if needed) the spool of `agent_id` under `root`.
    /// Reads what a previous run left: damaged records are logged and
    /// counted, fully acked segments are removed.
    pub fn open(root: &Path, agent_id: &str, max_bytes: u64) -> Result<Spool, SpoolError> {
        let dir = root.join(encode_agent_id(agent_id));
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        let lock = lock_dir(&dir)?;
        let state_path = dir.join(STATE_FILE);
        let (floor, high, state_problem) = read_state(&state_path);
        let saved = (state_problem.is_none() && state_path.exists()).then_some((floor, high));
        let mut spool = Spool {
            segment_bytes: (max_bytes / 8).clamp(MIN_SEGMENT_BYTES, MAX_SEGMENT_BYTES),
            dir,
            max_bytes,
            segments: Vec::new(),
            current: None,
            floor,
            high,
            saved,
            stats: SpoolStats::default(),
            _lock: lock,
        };
        let mut problems: Vec<SpoolProblem> = state_problem.into_iter().collect();
        for (number, path) in spool.segment_files(&mut problems)? {
            let (bytes, records, mut found) = read_segment(&path);
            problems.append(&mut found);
            let seqs: Vec<u64> = records.iter().map(|m| m.seq).collect();
            spool.high = spool.high.max(seqs.iter().copied().max().unwrap_or(0));
            spool.segments.push(Segment {
                number,
                path,
                bytes,
                seqs,
            });
        }
        spool.report(&problems);
        spool.remove_acked_segments();
        spool.refresh_stats();
        Ok(spool)
    }

    /// The agent ids that have a spool under `root`, e.g. for a restarted
    /// supervisor to find what a previous run left unsent.
    pub fn recover(root: &Path) -> Vec<String> {
        let Ok(entries) = fs::read_dir(root) else {
            return Vec::new();
        };
        let mut ids: Vec<String> = entries
            .flatten()
            .filter(|e| e.path().is_dir())
            .filter_map(|e| decode_agent_id(&e.file_name().to_string_lossy()))
            .collect();
        ids.sort();
        ids
    }

    /// The directory of this agent's spool.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The first seq a new run of this agent may use: above everything
    /// this spool has ever seen, so the collector's dedup never mistakes a
    /// new message for an old one.
    pub fn next_seq(&self) -> u64 {
        self.floor.max(self.high) + 1
    }

    /// The ack floor: every seq at or below it is done.
    pub fn acked_upto(&self) -> u64 {
        self.floor
    }

    /// True when everything ever appended is acked (or given up on).
    pub fn is_settled(&self) -> bool {
        self.floor >= self.high
    }

    /// Records who writes this spool (replacing the file atomically).
    pub fn set_origin(&mut self, origin: &Origin) -> Result<(), SpoolError> {
        let url = origin.collector_url.as_bytes();
        let mut buf = Vec::with_capacity(16 + url.len() + origin.hello.encoded_len());
        buf.extend_from_slice(ORIGIN_MAGIC);
        buf.extend_from_slice(&(url.len() as u32).to_le_bytes());
        buf.extend_from_slice(url);
        origin.hello.encode(&mut buf).unwrap_or_default(); // a Vec never runs out of room
        buf.extend_from_slice(&crc32(&buf).to_le_bytes());
        write_atomically(&self.dir, ORIGIN_FILE, &buf)
    }

    /// Who wrote this spool; `None` when it never said (an older agent, or
    /// one that died before writing it) or the file is damaged.
    pub fn origin(&self) -> Option<Origin> {
        let path = self.dir.join(ORIGIN_FILE);
        let bytes = fs::read(&path).ok()?;
        let parsed = parse_origin(&bytes);
        if parsed.is_none() {
            tracing::warn!(path = %path.display(), "oomscope spool: damaged origin file, ignored");
        }
        parsed
    }

    pub fn stats(&self) -> SpoolStats {
        self.stats.clone()
    }

    /// Appends one message. Returns the seqs of unacked messages dropped to
    /// stay under `max_bytes` (usually none). The data reaches the kernel
    /// before this returns, so it survives a crash of the process; call
    /// [`Spool::sync`] to make it survive a crash of the machine.
    pub fn append(&mut self, message: &pb::AgentMessage) -> Result<Vec<u64>, SpoolError> {
        let payload = message.encode_to_vec();
        if payload.len() > oomscope_proto::MAX_MESSAGE_BYTES {
            return Err(SpoolError::TooLarge {
                seq: message.seq,
                bytes: payload.len(),
                max: oomscope_proto::MAX_MESSAGE_BYTES,
            });
        }
        let mut record = Vec::with_capacity(RECORD_HEADER_BYTES + payload.len());
        record.extend_from_slice(RECORD_MAGIC);
        record.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        record.extend_from_slice(&crc32(&payload).to_le_bytes());
        record.extend_from_slice(&payload);

        let rollover = self
            .segments
            .last()
            .is_none_or(|s| s.bytes >= self.segment_bytes);
        if self.current.is_none() || rollover {
            self.start_segment()?;
        }
        let (Some(file), Some(segment)) = (self.current.as_mut(), self.segments.last_mut()) else {
            unreachable_segment();
            return Ok(Vec::new());
        };
        if let Err(e) = file.write_all(&record) {
            // A partial record may be on disk; the reader skips it. Start a
            // fresh segment next time rather than append after the tear.
            self.current = None;
            return Err(io_err(&segment.path)(e));
        }
        segment.bytes += record.len() as u64;
        segment.seqs.push(message.seq);
        self.high = self.high.max(message.seq);
        self.stats.appended += 1;
        let dropped = self.enforce_bound();
        self.refresh_stats();
        Ok(dropped)
    }

    /// Forces what was appended to stable storage (used for an OOM event).
    pub fn sync(&mut self) -> Result<(), SpoolError> {
        match (self.current.as_ref(), self.segments.last()) {
            (Some(file), Some(seg)) => file.sync_data().map_err(io_err(&seg.path)),
            _ => Ok(()),
        }
    }

    /// Records that every seq up to `upto` is acked, deleting the segments
    /// that hold nothing newer.
    pub fn ack(&mut self, upto: u64) -> Result<(), SpoolError> {
        if upto <= self.floor {
            return Ok(());
        }
        self.floor = upto;
        // The state is written before any segment goes, so that a crash in
        // between never lets a restarted agent reuse seqs.
        self.write_state()?;
        self.remove_acked_segments();
        self.refresh_stats();
        Ok(())
    }

    /// Every unacked message on disk, in seq order; damaged records are
    /// logged, counted in [`SpoolStats::problems`] and skipped.
    pub fn pending(&mut self) -> Result<Vec<pb::AgentMessage>, SpoolError> {
        let scan = self.scan()?;
        self.report(&scan.problems);
        Ok(scan.messages)
    }

    /// Reads every segment from disk, returning the unacked messages and
    /// what could not be read. Does not log or count.
    pub fn scan(&self) -> Result<SpoolScan, SpoolError> {
        let mut problems = Vec::new();
        let mut messages = Vec::new();
        for (_, path) in self.segment_files(&mut problems)? {
            let (_, records, mut found) = read_segment(&path);
            problems.append(&mut found);
            messages.extend(records.into_iter().filter(|m| m.seq > self.floor));
        }
        messages.sort_by_key(|m| m.seq);
        messages.dedup_by_key(|m| m.seq);
        Ok(SpoolScan { messages, problems })
    }

    fn report(&mut self, problems: &[SpoolProblem]) {
        for p in problems {
            tracing::warn!(problem = %p, "oomscope spool: skipped unreadable data");
        }
        self.stats.problems += problems.len() as u64;
    }

    /// Segment files in number order; anything else in the directory is
    /// reported as foreign and left alone.
    fn segment_files(
        &self,
        problems: &mut Vec<SpoolProblem>,
    ) -> Result<Vec<(u64, PathBuf)>, SpoolError> {
        let mut files = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(io_err(&self.dir))? {
            let entry = entry.map_err(io_err(&self.dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if [STATE_FILE, LOCK_FILE, ORIGIN_FILE].contains(&name.as_str())
                || name.ends_with(".tmp")
            {
                continue;
            }
            match parse_segment_name(&name) {
                Some(n) => files.push((n, entry.path())),
                None => problems.push(SpoolProblem {
                    path: entry.path(),
                    offset: 0,
                    reason: "not a spool segment (foreign file), ignored".into(),
                }),
            }
        }
        files.sort();
        Ok(files)
    }

    fn start_segment(&mut self) -> Result<(), SpoolError> {
        let number = self.segments.last().map_or(1, |s| s.number + 1);
        let path = self.dir.join(format!("seg-{number:016}.log"));
        let mut file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)
            .map_err(io_err(&path))?;
        file.write_all(SEGMENT_MAGIC).map_err(io_err(&path))?;
        self.segments.push(Segment {
            number,
            path,
            bytes: SEGMENT_MAGIC.len() as u64,
            seqs: Vec::new(),
        });
        self.current = Some(file);
        Ok(())
    }

    /// Deletes the oldest segments while over the bound, keeping the one
    /// being written. Returns the unacked seqs that went with them.
    fn enforce_bound(&mut self) -> Vec<u64> {
        let mut dropped = Vec::new();
        while self.total_bytes() > self.max_bytes && self.segments.len() > 1 {
            let oldest = self.segments.remove(0);
            let lost: Vec<u64> = oldest
                .seqs
                .iter()
                .copied()
                .filter(|&s| s > self.floor)
                .collect();
            tracing::warn!(
                path = %oldest.path.display(),
                records = lost.len(),
                bytes = oldest.bytes,
                max_bytes = self.max_bytes,
                "oomscope spool: over its disk bound, dropping the oldest segment"
            );
            if let Err(e) = fs::remove_file(&oldest.path) {
                tracing::warn!(path = %oldest.path.display(), error = %e, "oomscope spool: cannot delete segment");
            }
            self.stats.dropped_records += lost.len() as u64;
            self.stats.dropped_bytes += oldest.bytes;
            dropped.extend(lost);
        }
        dropped
    }

    fn remove_acked_segments(&mut self) {
        let floor = self.floor;
        let last = self.segments.len().saturating_sub(1);
        let mut keep = Vec::with_capacity(self.segments.len());
        for (i, seg) in std::mem::take(&mut self.segments).into_iter().enumerate() {
            // A segment with no readable record is left for a person to
            // look at; the disk bound removes it in its turn.
            if seg.seqs.is_empty() || seg.max_seq() > floor {
                keep.push(seg);
                continue;
            }
            if i == last && self.current.is_some() {
                self.current = None;
            }
            if let Err(e) = fs::remove_file(&seg.path) {
                tracing::warn!(path = %seg.path.display(), error = %e, "oomscope spool: cannot delete acked segment");
                keep.push(seg);
            }
        }
        self.segments = keep;
    }

    fn write_state(&mut self) -> Result<(), SpoolError> {
        let mut buf = Vec::with_capacity(24);
        buf.extend_from_slice(STATE_MAGIC);
        buf.extend_from_slice(&self.floor.to_le_bytes());
        buf.extend_from_slice(&self.high.to_le_bytes());
        buf.extend_from_slice(&crc32(&buf).to_le_bytes());
        write_atomically(&self.dir, STATE_FILE, &buf)?;
        self.saved = Some((self.floor, self.high));
        Ok(())
    }

    fn total_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.bytes).sum()
    }

    fn refresh_stats(&mut self) {
        self.stats.bytes = self.total_bytes();
        self.stats.segments = self.segments.len();
    }
}

impl Drop for Spool {
    fn drop(&mut self) {
        // Best effort: a stale floor only means some acked messages are sent
        // again, which the collector deduplicates.
        if self.saved == Some((self.floor, self.high)) {
            return;
        }
        if let Err(e) = self.write_state() {
            tracing::debug!(error = %e, "oomscope spool: could not save state on close");
        }
    }
}

#[cold]
fn unreachable_segment() {
    tracing::error!("oomscope spool: no open segment after starting one (bug)");
}

fn lock_dir(dir: &Path) -> Result<File, SpoolError> {
    let path = dir.join(LOCK_FILE);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_err(&path))?;
    // SAFETY: flock on a descriptor we own; the lock goes with the File.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let err = io::Error::last_os_error();
        return Err(if err.kind() == io::ErrorKind::WouldBlock {
            SpoolError::Locked {
                path: dir.to_path_buf(),
            }
        } else {
            SpoolError::Io { path, source: err }
        });
    }
    Ok(file)
}

/// (floor, high, problem). A missing file is a fresh spool; a damaged one is
/// reported and read as 0, which at worst resends acked messages.
fn read_state(path: &Path) -> (u64, u64, Option<SpoolProblem>) {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return (0, 0, None),
        Err(e) => {
            return (
                0,
                0,
                Some(problem(path, 0, format!("cannot read state: {e}"))),
            )
        }
    };
    let ok = bytes.len() == 24
        && &bytes[..4] == STATE_MAGIC
        && crc32(&bytes[..20]).to_le_bytes() == bytes[20..24];
    if !ok {
        return (
            0,
            0,
            Some(problem(
                path,
                0,
                "damaged state file, ack floor reset to 0".into(),
            )),
        );
    }
    let floor = u64::from_le_bytes(bytes[4..12].try_into().unwrap_or_default());
    let high = u64::from_le_bytes(bytes[12..20].try_into().unwrap_or_default());
    (floor, high, None)
}

/// Writes `dir/name` through a temporary file and a rename, so a reader sees
/// the old content or the new, never a torn one.
fn write_atomically(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), SpoolError> {
    let tmp = dir.join(format!("{name}.tmp"));
    fs::write(&tmp, bytes).map_err(io_err(&tmp))?;
    let path = dir.join(name);
    fs::rename(&tmp, &path).map_err(io_err(&path))
}

/// `[OSO1][url len: u32 LE][url][Hello][crc32 of all before: u32 LE]`.
fn parse_origin(bytes: &[u8]) -> Option<Origin> {
    let (body, crc) = bytes.split_last_chunk::<4>()?;
    if !body.starts_with(ORIGIN_MAGIC) || crc32(body).to_le_bytes() != *crc {
        return None;
    }
    let rest = &body[ORIGIN_MAGIC.len()..];
    let (len, rest) = rest.split_first_chunk::<4>()?;
    let len = u32::from_le_bytes(*len) as usize;
    if rest.len() < len {
        return None;
    }
    let (url, hello) = rest.split_at(len);
    Some(Origin {
        collector_url: String::from_utf8(url.to_vec()).ok()?,
        hello: pb::Hello::decode(hello).ok()?,
    })
}

fn problem(path: &Path, offset: u64, reason: String) -> SpoolProblem {
    SpoolProblem {
        path: path.to_path_buf(),
        offset,
        reason,
    }
}

/// Reads one segment file: its size, its good records, and a problem per
/// damaged stretch. Never fails: an unreadable file is one problem.
fn read_segment(path: &Path) -> (u64, Vec<pb::AgentMessage>, Vec<SpoolProblem>) {
    match fs::read(path) {
        Ok(bytes) => {
            let (records, problems) = parse_segment(path, &bytes);
            (bytes.len() as u64, records, problems)
        }
        Err(e) => (
            0,
            Vec::new(),
            vec![problem(path, 0, format!("cannot read: {e}"))],
        ),
    }
}

fn parse_segment(path: &Path, bytes: &[u8]) -> (Vec<pb::AgentMessage>, Vec<SpoolProblem>) {
    let mut records = Vec::new();
    let mut problems = Vec::new();
    let mut pos = if bytes.starts_with(SEGMENT_MAGIC) {
        SEGMENT_MAGIC.len()
    } else {
        problems.push(problem(
            path,
            0,
            "missing segment header (not written by oomscope?)".into(),
        ));
        0
    };
    while pos < bytes.len() {
        match parse_record(&bytes[pos..]) {
            Ok((message, used)) => {
                records.push(message);
                pos += used;
            }
            Err(reason) => {
                problems.push(problem(path, pos as u64, reason));
                // Resynchronise on the next record marker.
                match find(&bytes[pos + 1..], RECORD_MAGIC) {
                    Some(i) => pos += 1 + i,
                    None => break,
                }
            }
        }
    }
    (records, problems)
}

/// One record at the start of `rest`: the message and the bytes it used, or
/// why it is unreadable.
fn parse_record(rest: &[u8]) -> Result<(pb::AgentMessage, usize), String> {
    if !rest.starts_with(RECORD_MAGIC) {
        return Err("no record marker".into());
    }
    if rest.len() < RECORD_HEADER_BYTES {
        return Err(format!(
            "truncated record header ({} of {RECORD_HEADER_BYTES} bytes)",
            rest.len()
        ));
    }
    let len = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]) as usize;
    let crc = u32::from_le_bytes([rest[8], rest[9], rest[10], rest[11]]);
    let available = rest.len() - RECORD_HEADER_BYTES;
    if len > oomscope_proto::MAX_MESSAGE_BYTES {
        return Err(format!("record length {len} is over the message limit"));
    }
    if len > available {
        return Err(format!("truncated record ({available} of {len} bytes)"));
    }
    let payload = &rest[RECORD_HEADER_BYTES..RECORD_HEADER_BYTES + len];
    if crc32(payload) != crc {
        return Err("checksum mismatch".into());
    }
    let message = pb::AgentMessage::decode(payload)
        .map_err(|e| format!("checksum ok but not a message: {e}"))?;
    Ok((message, RECORD_HEADER_BYTES + len))
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn parse_segment_name(name: &str) -> Option<u64> {
    name.strip_prefix("seg-")?
        .strip_suffix(".log")?
        .parse()
        .ok()
}

/// Agent ids become directory names: safe bytes kept, the rest `%XX`, so
/// that any id maps to one directory and back.
pub fn encode_agent_id(agent_id: &str) -> String {
    if agent_id.is_empty() {
        return "%".into();
    }
    let mut out = String::with_capacity(agent_id.len());
    for (i, b) in agent_id.bytes().enumerate() {
        let safe = b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || (b == b'.' && i > 0);
        if safe {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

pub fn decode_agent_id(name: &str) -> Option<String> {
    if name == "%" {
        return Some(String::new());
    }
    let bytes = name.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = name.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// CRC-32 (IEEE 802.3, the zlib/PNG one), table-driven.
pub fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc = CRC_TABLE[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

const CRC_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
    }

    #[test]
    fn agent_ids_round_trip_through_directory_names() {
        for id in ["a", "host-1_x.y", "../etc", "a/b c", "", "ünï"] {
            let name = encode_agent_id(id);
            assert!(!name.contains('/') && name != "." && name != "..", "{name}");
            assert_eq!(decode_agent_id(&name).as_deref(), Some(id));
        }
    }
}
