//! Allocator counters on the wire as changes against the previous sample.
//!
//! PyTorch's allocator reports about 122 counters per device, and between two
//! samples most of them keep their value, so a sample's `raw` map (most of its
//! 4 KiB) shrinks to the few that moved. The sender's [`Encoder`] and the
//! collector's [`Decoder`] each live for one stream: the first sample of a
//! stream (so every sample after a reconnect) is always complete, and each
//! side keeps the last complete counters per device, updated by every sample
//! in stream order. Only `AllocatorStats.raw` of a Sample is encoded; what is
//! stored, replayed, captured or queried always has full values.

use std::collections::HashMap;

use prost::Message;

use crate::v1::agent_message::Body;
use crate::v1::{AgentMessage, AllocatorStats, RawChanges};

/// One device's counters, sorted by key: positions in it are what
/// `RawChanges.index` names.
type Counters = Vec<(String, i64)>;

fn sorted(raw: &HashMap<String, i64>) -> Counters {
    let mut v: Counters = raw.iter().map(|(k, v)| (k.clone(), *v)).collect();
    v.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    v
}

/// The bytes `raw` takes in its message (field 22, one entry per counter).
fn raw_len(raw: &HashMap<String, i64>) -> usize {
    prost::encoding::hash_map::encoded_len(
        prost::encoding::string::encoded_len,
        prost::encoding::int64::encoded_len,
        22,
        raw,
    )
}

/// The sender's half, one per stream.
#[derive(Default)]
pub struct Encoder {
    previous: HashMap<i32, Counters>,
}

impl Encoder {
    /// A fresh stream: its first sample goes out complete.
    pub fn new() -> Encoder {
        Encoder::default()
    }

    /// `message` as it goes on the stream: a Sample's counters as changes
    /// wherever the previous sample of the same device had the same keys and
    /// the changes are smaller. Every other message passes unchanged.
    pub fn encode(&mut self, mut message: AgentMessage) -> AgentMessage {
        if let Some(Body::Sample(sample)) = &mut message.body {
            for stats in &mut sample.allocator {
                self.encode_stats(stats);
            }
        }
        message
    }

    fn encode_stats(&mut self, stats: &mut AllocatorStats) {
        let Some(changes) = remember(&mut self.previous, stats.device, &stats.raw) else {
            return;
        };
        if changes.encoded_len() + 2 < raw_len(&stats.raw) {
            stats.raw.clear();
            stats.raw_changes = Some(changes);
        }
    }
}

/// Makes `previous[device]` hold `raw`, and returns the changes from what it
/// held when the keys are the same: then in place, copying no key (this runs
/// for every sample on both ends of a stream).
fn remember(
    previous: &mut HashMap<i32, Counters>,
    device: i32,
    raw: &HashMap<String, i64>,
) -> Option<RawChanges> {
    if let Some(before) = previous.get_mut(&device) {
        // The same length and every old key present: the same keys.
        let values: Option<Vec<i64>> = (before.len() == raw.len())
            .then(|| before.iter().map(|(k, _)| raw.get(k).copied()).collect())
            .flatten();
        if let Some(values) = values {
            let mut out = RawChanges::default();
            for (i, ((_, old), new)) in before.iter_mut().zip(values).enumerate() {
                if *old != new {
                    // Positions fit: a map with 2^32 keys is over any message limit.
                    out.index.push(i as u32);
                    out.change.push(new.wrapping_sub(*old));
                    *old = new;
                }
            }
            return Some(out);
        }
    }
    previous.insert(device, sorted(raw));
    None
}

/// Why a sample's changes could not be applied: the sender broke the
/// protocol (the collector rejects that message and keeps the stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeltaError(pub String);

impl std::fmt::Display for DeltaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DeltaError {}

/// The collector's half, one per stream.
#[derive(Default)]
pub struct Decoder {
    previous: HashMap<i32, Counters>,
}

impl Decoder {
    /// A fresh stream: it knows no previous sample.
    pub fn new() -> Decoder {
        Decoder::default()
    }

    /// Rebuilds full counters in `message` (a Sample's changes applied to
    /// the previous sample's values). On an error the message is left
    /// unusable and the state as it was for the device that failed.
    pub fn decode(&mut self, message: &mut AgentMessage) -> Result<(), DeltaError> {
        if let Some(Body::Sample(sample)) = &mut message.body {
            for stats in &mut sample.allocator {
                self.decode_stats(stats)?;
            }
        }
        Ok(())
    }

    fn decode_stats(&mut self, stats: &mut AllocatorStats) -> Result<(), DeltaError> {
        let Some(changes) = stats.raw_changes.take() else {
            remember(&mut self.previous, stats.device, &stats.raw);
            return Ok(());
        };
        let device = stats.device;
        let counters = self.previous.get_mut(&device).ok_or_else(|| {
            DeltaError(format!(
                "allocator counters of device {device} sent as changes, but no earlier sample of this stream had them (the first sample of a stream must be complete)"
            ))
        })?;
        // Checked whole before any is applied: a bad sample leaves the base as it was.
        if changes.index.len() != changes.change.len() {
            return Err(DeltaError(format!(
                "device {device}: {} changed positions but {} changes",
                changes.index.len(),
                changes.change.len()
            )));
        }
        if let Some(i) = changes
            .index
            .iter()
            .find(|&&i| i as usize >= counters.len())
        {
            return Err(DeltaError(format!(
                "device {device}: changed position {i} beyond the {} counters of the previous sample",
                counters.len()
            )));
        }
        if !stats.raw.is_empty() {
            return Err(DeltaError(format!(
                "device {device}: both full counters and changes"
            )));
        }
        for (&i, &change) in changes.index.iter().zip(&changes.change) {
            let value = &mut counters[i as usize].1;
            *value = value.wrapping_add(change);
        }
        stats.raw = counters.iter().cloned().collect();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::Sample;

    fn sample(seq: u64, counters: &[(&str, i64)]) -> AgentMessage {
        AgentMessage {
            seq,
            body: Some(Body::Sample(Sample {
                allocator: vec![AllocatorStats {
                    device: 0,
                    raw: counters.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
                    ..Default::default()
                }],
                ..Default::default()
            })),
        }
    }

    fn stats(m: &AgentMessage) -> &AllocatorStats {
        match &m.body {
            Some(Body::Sample(s)) => &s.allocator[0],
            _ => panic!("not a sample"),
        }
    }

    fn many(n: i64, bump: i64) -> Vec<(String, i64)> {
        (0..n)
            .map(|i| {
                (
                    format!("allocated_bytes.counter_{i}.current"),
                    i * 1000 + bump * (i % 7 == 0) as i64,
                )
            })
            .collect()
    }

    fn msg(seq: u64, c: &[(String, i64)]) -> AgentMessage {
        let c: Vec<(&str, i64)> = c.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        sample(seq, &c)
    }

    #[test]
    fn first_is_complete_then_changes_round_trip() {
        let (mut enc, mut dec) = (Encoder::new(), Decoder::new());
        let originals = [
            msg(1, &many(120, 0)),
            msg(2, &many(120, 5)),
            msg(3, &many(120, i64::MIN)),
        ];
        for (n, original) in originals.iter().enumerate() {
            let mut wire = enc.encode(original.clone());
            assert_eq!(stats(&wire).raw_changes.is_some(), n > 0, "sample {n}");
            if n > 0 {
                assert!(wire.encoded_len() * 4 < original.encoded_len());
            }
            dec.decode(&mut wire).unwrap();
            assert_eq!(&wire, original);
        }
    }

    #[test]
    fn changed_keys_or_a_new_stream_send_complete_counters() {
        let mut enc = Encoder::new();
        enc.encode(msg(1, &many(120, 0)));
        let fewer = enc.encode(msg(2, &many(119, 0)));
        assert!(stats(&fewer).raw_changes.is_none());
        assert_eq!(stats(&fewer).raw.len(), 119);
        let mut again = Encoder::new();
        assert!(stats(&again.encode(msg(3, &many(119, 1))))
            .raw_changes
            .is_none());
    }

    #[test]
    fn changes_without_a_base_or_out_of_range_are_errors() {
        let mut enc = Encoder::new();
        enc.encode(msg(1, &many(120, 0)));
        let wire = enc.encode(msg(2, &many(120, 3)));
        let err = Decoder::new().decode(&mut wire.clone()).unwrap_err();
        assert!(
            err.0.contains("first sample of a stream must be complete"),
            "{err}"
        );

        let mut dec = Decoder::new();
        dec.decode(&mut msg(1, &many(10, 0))).unwrap();
        let err = dec.decode(&mut wire.clone()).unwrap_err();
        assert!(err.0.contains("beyond the 10 counters"), "{err}");
    }
}
