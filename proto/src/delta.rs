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
use std::sync::Arc;

use prost::Message;

use crate::v1::agent_message::Body;
use crate::v1::{AgentMessage, AllocatorStats, RawChanges};

/// One device's counters, sorted by key: positions in it are what
/// `RawChanges.index` names. The keys are shared, so that a copy of a
/// stream's counters at one sample ([`Complete`]) copies only the values.
#[derive(Clone, Debug, PartialEq)]
struct Counters {
    keys: Arc<[String]>,
    values: Vec<i64>,
}

impl Counters {
    fn of(raw: &HashMap<String, i64>) -> Counters {
        let mut v: Vec<(&String, i64)> = raw.iter().map(|(k, v)| (k, *v)).collect();
        v.sort_unstable_by(|a, b| a.0.cmp(b.0));
        Counters {
            keys: v.iter().map(|(k, _)| (*k).clone()).collect(),
            values: v.into_iter().map(|(_, v)| v).collect(),
        }
    }

    fn to_raw(&self) -> HashMap<String, i64> {
        self.keys
            .iter()
            .cloned()
            .zip(self.values.iter().copied())
            .collect()
    }

    /// What `raw_len` says of the same counters as a map, entry by entry
    /// as prost encodes a map (a default key or value is left out).
    fn raw_len(&self) -> usize {
        use prost::encoding::{encoded_len_varint, key_len};
        let entries: usize = self
            .keys
            .iter()
            .zip(&self.values)
            .map(|(k, &v)| {
                let key = match k.is_empty() {
                    true => 0,
                    false => 1 + encoded_len_varint(k.len() as u64) + k.len(),
                };
                let value = match v {
                    0 => 0,
                    v => 1 + encoded_len_varint(v as u64),
                };
                encoded_len_varint((key + value) as u64) + key + value
            })
            .sum();
        key_len(RAW_TAG) * self.keys.len() + entries
    }
}

/// `AllocatorStats.raw`'s field number.
const RAW_TAG: u32 = 22;
/// `AllocatorStats.raw_changes`'s field number.
const RAW_CHANGES_TAG: u32 = 23;
/// One device's complete counters at one sample of a stream, as the
/// [`Decoder`] held them after it (see [`Decoder::follow`]): the keys are
/// shared with the decoder, the values copied.
#[derive(Clone, Debug, PartialEq)]
pub struct Complete {
    counters: Counters,
}

impl Complete {
    /// The counters as `AllocatorStats.raw` holds them.
    pub fn to_raw(&self) -> HashMap<String, i64> {
        self.counters.to_raw()
    }
}

/// The encoded length of `message` had its counters been complete:
/// `complete` is what [`Decoder::follow`] returned for it. This is
/// `message.encoded_len()` after [`Decoder::decode`], without building the maps.
pub fn complete_len(message: &AgentMessage, complete: &[Complete]) -> usize {
    let Some(Body::Sample(sample)) = &message.body else {
        return message.encoded_len();
    };
    // A length-delimited field's key is the same whatever its length: only
    // the lengths and their varints change.
    let delimited = |len: usize| prost::encoding::encoded_len_varint(len as u64) + len;
    let mut sample_len = sample.encoded_len();
    for (stats, c) in sample.allocator.iter().zip(complete) {
        let Some(changes) = &stats.raw_changes else {
            continue;
        };
        let wire = stats.encoded_len();
        let whole = wire - prost::encoding::message::encoded_len(RAW_CHANGES_TAG, changes)
            + c.counters.raw_len();
        sample_len = sample_len - delimited(wire) + delimited(whole);
    }
    message.encoded_len() - delimited(sample.encoded_len()) + delimited(sample_len)
}

/// The bytes `raw` takes in its message (field 22, one entry per counter).
fn raw_len(raw: &HashMap<String, i64>) -> usize {
    prost::encoding::hash_map::encoded_len(
        prost::encoding::string::encoded_len,
        prost::encoding::int64::encoded_len,
        RAW_TAG,
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
        let values: Option<Vec<i64>> = (before.keys.len() == raw.len())
            .then(|| before.keys.iter().map(|k| raw.get(k).copied()).collect())
            .flatten();
        if let Some(values) = values {
            let mut out = RawChanges::default();
            for (i, (old, new)) in before.values.iter_mut().zip(values).enumerate() {
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
    previous.insert(device, Counters::of(raw));
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
                if stats.raw_changes.is_none() {
                    remember(&mut self.previous, stats.device, &stats.raw);
                    continue;
                }
                let raw = self.apply(stats)?.to_raw();
                stats.raw_changes = None;
                stats.raw = raw;
            }
        }
        Ok(())
    }

    /// Follows the stream through `message` as [`Decoder::decode`] does, but
    /// leaves its changes as they came (the collector stores them so): returns
    /// each `AllocatorStats`' complete counters after it, in the message's
    /// order (empty for any other message). Errors as `decode`'s.
    pub fn follow(&mut self, message: &AgentMessage) -> Result<Vec<Complete>, DeltaError> {
        let Some(Body::Sample(sample)) = &message.body else {
            return Ok(Vec::new());
        };
        let mut out = Vec::with_capacity(sample.allocator.len());
        for stats in &sample.allocator {
            out.push(Complete {
                counters: self.apply(stats)?.clone(),
            });
        }
        Ok(out)
    }

    /// Takes `stats` (complete, or changes) into the device's counters and
    /// returns them.
    fn apply(&mut self, stats: &AllocatorStats) -> Result<&Counters, DeltaError> {
        let device = stats.device;
        let Some(changes) = &stats.raw_changes else {
            remember(&mut self.previous, device, &stats.raw);
            return Ok(&self.previous[&device]);
        };
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
            .find(|&&i| i as usize >= counters.values.len())
        {
            return Err(DeltaError(format!(
                "device {device}: changed position {i} beyond the {} counters of the previous sample",
                counters.values.len()
            )));
        }
        if !stats.raw.is_empty() {
            return Err(DeltaError(format!(
                "device {device}: both full counters and changes"
            )));
        }
        for (&i, &change) in changes.index.iter().zip(&changes.change) {
            let value = &mut counters.values[i as usize];
            *value = value.wrapping_add(change);
        }
        Ok(counters)
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

    /// Two devices; device 1's keys change at the fourth sample (it goes
    /// complete mid-stream); values include zeros (left out of a map entry),
    /// negatives and an empty key.
    fn two_devices(seq: u64) -> AgentMessage {
        let stats = |device: i32| {
            let n = if device == 1 && seq >= 4 { 90 } else { 120 };
            let mut raw: HashMap<String, i64> = (0..n)
                .map(|i: i64| {
                    let v = match i % 5 {
                        0 => 0,
                        1 => -(seq as i64) * 1_000_003,
                        _ => i * 1000 + (seq as i64 % (i + 1)) * (1 << 40),
                    };
                    (format!("counter.{i}.current"), v)
                })
                .collect();
            raw.insert(String::new(), seq as i64);
            AllocatorStats {
                device,
                allocated_bytes: seq * 7,
                raw,
                ..Default::default()
            }
        };
        AgentMessage {
            seq,
            body: Some(Body::Sample(Sample {
                time_ns: seq as i64,
                allocator: vec![stats(0), stats(1)],
                ..Default::default()
            })),
        }
    }

    #[test]
    fn follow_leaves_the_changes_and_gives_what_decode_rebuilds() {
        let mut enc = Encoder::new();
        let (mut decoding, mut following) = (Decoder::new(), Decoder::new());
        for seq in 1..=8 {
            let original = two_devices(seq);
            let wire = enc.encode(original.clone());
            let complete = following.follow(&wire).unwrap();
            let mut decoded = wire.clone();
            decoding.decode(&mut decoded).unwrap();
            assert_eq!(decoded, original, "seq {seq}");
            let Some(Body::Sample(s)) = &original.body else {
                unreachable!()
            };
            assert_eq!(complete.len(), 2);
            for (c, stats) in complete.iter().zip(&s.allocator) {
                assert_eq!(c.to_raw(), stats.raw, "seq {seq} device {}", stats.device);
            }
            // Byte for byte the length of the complete message, changes or not.
            assert_eq!(
                complete_len(&wire, &complete),
                original.encoded_len(),
                "seq {seq}"
            );
            if seq > 1 {
                assert!(stats(&wire).raw_changes.is_some(), "seq {seq}");
            }
        }
        // Not a sample: nothing to follow, and its own length.
        let goodbye = AgentMessage {
            seq: 9,
            body: Some(Body::Goodbye(Default::default())),
        };
        assert!(following.follow(&goodbye).unwrap().is_empty());
        assert_eq!(complete_len(&goodbye, &[]), goodbye.encoded_len());
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
