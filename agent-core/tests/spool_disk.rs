//! The on-disk spool against real files: acks, the disk bound, restarts, and
//! damaged data (garbage files, torn records, flipped bytes).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use oomscope_agent_core::pb;
use oomscope_agent_core::spool::{encode_agent_id, Spool, SpoolError, SEGMENT_MAGIC};

fn sample(seq: u64) -> pb::AgentMessage {
    pb::AgentMessage {
        seq,
        body: Some(pb::agent_message::Body::Sample(pb::Sample {
            time_ns: 1_700_000_000_000_000_000 + seq as i64,
            step: seq,
            // Some bulk, so that segments fill after a few dozen records.
            context: Some(pb::RequestContext {
                request_id: format!("request-{seq:06}-{}", "x".repeat(150)),
                ..Default::default()
            }),
            ..Default::default()
        })),
    }
}

fn seqs(messages: &[pb::AgentMessage]) -> Vec<u64> {
    messages.iter().map(|m| m.seq).collect()
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("seg-"))
        .collect();
    files.sort();
    files
}

#[test]
fn pending_returns_appended_messages_in_seq_order_and_survives_reopen() {
    let root = tempfile::tempdir().unwrap();
    {
        let mut spool = Spool::open(root.path(), "agent/1", 1 << 20).unwrap();
        assert_eq!(spool.next_seq(), 1);
        for seq in [1, 2, 4, 3, 5] {
            assert_eq!(spool.append(&sample(seq)).unwrap(), Vec::<u64>::new());
        }
        let pending = spool.pending().unwrap();
        assert_eq!(seqs(&pending), vec![1, 2, 3, 4, 5]);
        assert_eq!(pending[2], sample(3), "content must round-trip exactly");
    }
    let mut spool = Spool::open(root.path(), "agent/1", 1 << 20).unwrap();
    assert_eq!(seqs(&spool.pending().unwrap()), vec![1, 2, 3, 4, 5]);
    assert_eq!(spool.next_seq(), 6);
    assert_eq!(spool.stats().problems, 0);
    assert_eq!(Spool::recover(root.path()), vec!["agent/1".to_string()]);
}

#[test]
fn ack_deletes_fully_acked_segments_and_the_floor_survives_a_restart() {
    let root = tempfile::tempdir().unwrap();
    // A 128 KiB bound gives 16 KiB segments of about 80 records each, and
    // 300 records fit without dropping any.
    let max = 128 * 1024;
    {
        let mut spool = Spool::open(root.path(), "a", max).unwrap();
        let dir = spool.dir().to_path_buf();
        for seq in 1..=300 {
            spool.append(&sample(seq)).unwrap();
        }
        let before = segments(&dir).len();
        assert!(before >= 3, "expected several segments, got {before}");
        spool.ack(200).unwrap();
        let after = segments(&dir).len();
        assert!(
            after < before,
            "acked segments must go: {before} -> {after}"
        );
        assert_eq!(
            seqs(&spool.pending().unwrap()),
            (201..=300).collect::<Vec<_>>()
        );
        spool.ack(300).unwrap();
        assert!(segments(&dir).is_empty(), "all acked: {:?}", segments(&dir));
        assert_eq!(spool.stats().dropped_records, 0);
    }
    // Everything was acked and deleted; the seq must still continue.
    let mut spool = Spool::open(root.path(), "a", max).unwrap();
    assert_eq!(spool.next_seq(), 301);
    assert!(spool.pending().unwrap().is_empty());
}

#[test]
fn over_the_disk_bound_the_oldest_segment_goes_and_is_counted() {
    let root = tempfile::tempdir().unwrap();
    let max: u64 = 64 * 1024;
    let mut spool = Spool::open(root.path(), "bounded", max).unwrap();
    let mut dropped = Vec::new();
    for seq in 1..=2000 {
        dropped.extend(spool.append(&sample(seq)).unwrap());
    }
    let stats = spool.stats();
    let pending = seqs(&spool.pending().unwrap());
    assert!(!dropped.is_empty());
    assert_eq!(stats.dropped_records, dropped.len() as u64);
    assert!(
        stats.bytes <= max,
        "{} bytes on disk, bound {max}",
        stats.bytes
    );
    // What is left is exactly the newest tail, nothing lost silently.
    assert_eq!(dropped.len() + pending.len(), 2000);
    assert_eq!(dropped, (1..=dropped.len() as u64).collect::<Vec<_>>());
    assert_eq!(
        pending,
        (dropped.len() as u64 + 1..=2000).collect::<Vec<_>>()
    );
    let on_disk: u64 = segments(spool.dir())
        .iter()
        .map(|p| fs::metadata(p).unwrap().len())
        .sum();
    assert_eq!(on_disk, stats.bytes);
}

#[test]
fn garbage_files_torn_and_flipped_records_are_reported_and_good_records_kept() {
    let root = tempfile::tempdir().unwrap();
    let dir = {
        let mut spool = Spool::open(root.path(), "damaged", 1 << 20).unwrap();
        for seq in 1..=10 {
            spool.append(&sample(seq)).unwrap();
        }
        spool.dir().to_path_buf()
    };
    let good = segments(&dir);
    assert_eq!(good.len(), 1);
    let mut bytes = fs::read(&good[0]).unwrap();
    // Flip one payload byte of the 5th record: its checksum must fail.
    let record_len = (bytes.len() - SEGMENT_MAGIC.len()) / 10;
    let fifth = SEGMENT_MAGIC.len() + 4 * record_len + 12 + 20;
    bytes[fifth] ^= 0x55;
    // A torn record at the end, as a crash mid-append leaves it.
    let torn = sample(11);
    let full = {
        let mut s = Spool::open(&root.path().join("scratch"), "x", 1 << 20).unwrap();
        s.append(&torn).unwrap();
        fs::read(&segments(s.dir())[0]).unwrap()
    };
    bytes.extend_from_slice(&full[SEGMENT_MAGIC.len()..full.len() - 30]);
    fs::write(&good[0], &bytes).unwrap();
    // A file named like a segment holding garbage, and a foreign file.
    let garbage: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    fs::write(dir.join("seg-0000000000000099.log"), garbage).unwrap();
    fs::File::create(dir.join("notes.txt"))
        .unwrap()
        .write_all(b"hello")
        .unwrap();

    let mut spool = Spool::open(root.path(), "damaged", 1 << 20).unwrap();
    let scan = spool.scan().unwrap();
    assert_eq!(seqs(&scan.messages), vec![1, 2, 3, 4, 6, 7, 8, 9, 10]);
    let reasons: Vec<String> = scan.problems.iter().map(|p| p.to_string()).collect();
    let has = |needle: &str| reasons.iter().any(|r| r.contains(needle));
    assert!(has("checksum mismatch"), "{reasons:#?}");
    assert!(has("truncated record"), "{reasons:#?}");
    assert!(has("missing segment header"), "{reasons:#?}");
    assert!(has("notes.txt") && has("foreign file"), "{reasons:#?}");
    let checksum = scan
        .problems
        .iter()
        .find(|p| p.reason.contains("checksum"))
        .unwrap();
    assert_eq!(
        checksum.offset,
        (SEGMENT_MAGIC.len() + 4 * record_len) as u64
    );

    // pending() gives the same good records and counts the bad ones.
    let before = spool.stats().problems;
    assert_eq!(
        seqs(&spool.pending().unwrap()),
        vec![1, 2, 3, 4, 6, 7, 8, 9, 10]
    );
    assert_eq!(spool.stats().problems, before + scan.problems.len() as u64);
    // New appends after the damage are readable too.
    assert!(spool.next_seq() >= 11);
    spool.append(&sample(12)).unwrap();
    assert_eq!(seqs(&spool.pending().unwrap()).last(), Some(&12));
}

#[test]
fn a_damaged_state_file_is_reported_not_fatal() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join(encode_agent_id("s"));
    {
        let mut spool = Spool::open(root.path(), "s", 1 << 20).unwrap();
        spool.append(&sample(1)).unwrap();
        spool.append(&sample(2)).unwrap();
        spool.ack(1).unwrap();
    }
    fs::write(dir.join("state"), b"\x00\x01garbage").unwrap();
    let mut spool = Spool::open(root.path(), "s", 1 << 20).unwrap();
    assert!(spool.stats().problems >= 1);
    // The floor fell back to 0; unacked seq 2 is still there.
    assert!(seqs(&spool.pending().unwrap()).contains(&2));
    assert_eq!(spool.next_seq(), 3);
}

#[test]
fn a_second_open_of_the_same_agent_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let _first = Spool::open(root.path(), "one", 1 << 20).unwrap();
    match Spool::open(root.path(), "one", 1 << 20) {
        Err(SpoolError::Locked { .. }) => {}
        other => panic!("expected Locked, got {other:?}"),
    }
    // Another agent id is independent.
    assert!(Spool::open(root.path(), "two", 1 << 20).is_ok());
}

#[test]
fn an_unwritable_root_is_an_error_not_a_panic() {
    let root = tempfile::tempdir().unwrap();
    let file = root.path().join("plain-file");
    fs::write(&file, b"").unwrap();
    let err = Spool::open(&file, "x", 1 << 20).unwrap_err();
    assert!(err.to_string().contains("plain-file"), "{err}");
}

#[test]
fn origin_round_trips_and_a_damaged_one_reads_as_none() {
    use oomscope_agent_core::spool::Origin;
    let root = tempfile::tempdir().unwrap();
    let origin = Origin {
        collector_url: "http://collector:7433".into(),
        hello: pb::Hello {
            agent_id: "agent/1".into(),
            name: "server".into(),
            pid: 42,
            ..Default::default()
        },
    };
    let mut spool = Spool::open(root.path(), "agent/1", 1 << 20).unwrap();
    assert_eq!(spool.origin(), None, "never written");
    spool.set_origin(&origin).unwrap();
    assert_eq!(spool.origin(), Some(origin.clone()));
    spool.append(&sample(1)).unwrap();
    assert_eq!(spool.stats().problems, 0, "the origin file is not foreign");
    drop(spool);

    let path = root.path().join(encode_agent_id("agent/1")).join("origin");
    let mut bytes = fs::read(&path).unwrap();
    let last = bytes.len() - 6;
    bytes[last] ^= 0x40;
    fs::write(&path, &bytes).unwrap();
    let spool = Spool::open(root.path(), "agent/1", 1 << 20).unwrap();
    assert_eq!(spool.origin(), None, "a flipped byte fails the checksum");
    fs::write(&path, b"OSO1").unwrap();
    assert_eq!(spool.origin(), None, "truncated");
}

#[test]
fn settled_means_everything_appended_is_acked_and_survives_reopen() {
    let root = tempfile::tempdir().unwrap();
    let mut spool = Spool::open(root.path(), "agent/1", 1 << 20).unwrap();
    assert!(spool.is_settled(), "nothing appended yet");
    spool.append(&sample(1)).unwrap();
    spool.append(&sample(2)).unwrap();
    assert!(!spool.is_settled());
    spool.ack(1).unwrap();
    assert!(!spool.is_settled());
    spool.ack(2).unwrap();
    assert!(spool.is_settled());
    assert!(matches!(
        Spool::open(root.path(), "agent/1", 1 << 20),
        Err(SpoolError::Locked { .. })
    ));
    drop(spool);
    let state = root.path().join(encode_agent_id("agent/1")).join("state");
    let inode = || std::os::unix::fs::MetadataExt::ino(&fs::metadata(&state).unwrap());
    let written = inode();
    let spool = Spool::open(root.path(), "agent/1", 1 << 20).unwrap();
    assert!(spool.is_settled());
    assert_eq!(spool.next_seq(), 3, "seqs go on above the old ones");
    assert_eq!(spool.stats().segments, 0, "acked segments are gone");
    drop(spool);
    assert_eq!(
        inode(),
        written,
        "closing an unchanged spool rewrites nothing"
    );
}
