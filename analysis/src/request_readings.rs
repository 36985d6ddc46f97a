//! The one place where a batch of request readings (`Sample.requests`, one
//! message per batch from the agent's boundary ring) becomes the boundary
//! points and request events the rules read: a boundary sample for each
//! request end (its RSS, allocators and NVML's per-process figure where
//! read, and context), and a
//! `request` event for each begin and end. The growth, KV, concurrency and
//! probe rules so read a batch exactly as they read one message per
//! boundary before; older agents' messages pass through unchanged.

use crate::pb;
use crate::pb::event::Kind;

/// What one batch stands for besides the sample that carried it.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Expanded {
    /// The boundary points of the batch's ends, oldest first, but for the
    /// end the carrying sample itself stands for (the one at its time).
    pub samples: Vec<pb::Sample>,
    /// A `request` event per begin and end, oldest first.
    pub events: Vec<pb::Event>,
}

/// Takes the readings out of `sample` (what was thinned stays on it, to be
/// stated) and returns the points and events they stand for.
pub fn expand(sample: &mut pb::Sample) -> Expanded {
    let Some(mut batch) = sample.requests.take() else {
        return Expanded::default();
    };
    let readings = std::mem::take(&mut batch.readings);
    if batch.thinned_requests > 0 {
        sample.requests = Some(batch);
    }
    // The newest end at the sample's own time is the sample itself.
    let own = readings
        .iter()
        .rposition(|r| r.boundary.as_ref().is_some_and(|b| !b.start))
        .filter(|&i| readings[i].time_ns == sample.time_ns);
    let process = |rss: u64| {
        let p = sample.process.unwrap_or_default();
        pb::ProcessMemory {
            pid: p.pid,
            vm_rss_bytes: rss,
            address_space_limit_bytes: p.address_space_limit_bytes,
            data_limit_bytes: p.data_limit_bytes,
            // The agent's own heap as read with the batch (it moves slowly):
            // the growth rules subtract it from every point alike, else the
            // agent's first seconds of buffers read as the server's growth.
            agent_heap_bytes: p.agent_heap_bytes,
            ..Default::default()
        }
    };
    let mut out = Expanded::default();
    for (i, r) in readings.into_iter().enumerate() {
        let Some(boundary) = r.boundary else { continue };
        if !boundary.start && Some(i) != own {
            out.samples.push(pb::Sample {
                time_ns: r.time_ns,
                process: (r.rss_bytes > 0).then(|| process(r.rss_bytes)),
                allocator: r.allocator,
                context: r.context,
                gpu_processes: r.gpu_processes,
                ..Default::default()
            });
        }
        out.events.push(pb::Event {
            time_ns: r.time_ns,
            kind: Some(Kind::Request(boundary)),
        });
    }
    out
}

/// Every batch in `samples` expanded in place: its points among the
/// samples and its request events among `events`, each list in time order
/// (stable: what was there first stays first at equal times).
pub fn expand_all(samples: &mut Vec<pb::Sample>, events: &mut Vec<pb::Event>) {
    let mut extra = Expanded::default();
    for s in samples.iter_mut() {
        let e = expand(s);
        extra.samples.extend(e.samples);
        extra.events.extend(e.events);
    }
    if !extra.samples.is_empty() {
        samples.extend(extra.samples);
        samples.sort_by_key(|s| s.time_ns);
    }
    if !extra.events.is_empty() {
        events.extend(extra.events);
        events.sort_by_key(|e| e.time_ns);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(t: i64, id: &str, start: bool, done: u64, rss: u64) -> pb::RequestReading {
        pb::RequestReading {
            time_ns: t,
            boundary: Some(pb::RequestBoundary {
                request_id: id.into(),
                start,
                ..Default::default()
            }),
            rss_bytes: rss,
            context: (!start).then(|| pb::RequestContext {
                requests_done: done,
                phase: "after_request".into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn batch_sample() -> pb::Sample {
        pb::Sample {
            time_ns: 40,
            process: Some(pb::ProcessMemory {
                pid: 7,
                vm_rss_bytes: 500,
                agent_heap_bytes: 64,
                ..Default::default()
            }),
            context: Some(pb::RequestContext {
                requests_done: 2,
                ..Default::default()
            }),
            requests: Some(pb::RequestReadings {
                readings: vec![
                    reading(10, "a", true, 0, 0),
                    reading(20, "a", false, 1, 300),
                    reading(25, "b", true, 0, 0),
                    reading(30, "c", true, 0, 0),
                    reading(40, "b", false, 2, 400),
                ],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_batch_becomes_a_point_per_end_and_an_event_per_boundary() {
        let mut s = batch_sample();
        let e = expand(&mut s);
        assert_eq!(s.requests, None);
        // The end at the sample's own time is the sample; the other gets a
        // point of its own with its RSS and context.
        assert_eq!(e.samples.len(), 1);
        let p = &e.samples[0];
        assert_eq!(p.time_ns, 20);
        assert_eq!(p.process.unwrap().vm_rss_bytes, 300);
        assert_eq!(p.process.unwrap().pid, 7);
        // The agent's own heap read with the batch, which the rules subtract.
        assert_eq!(p.process.unwrap().agent_heap_bytes, 64);
        assert_eq!(p.context.as_ref().unwrap().requests_done, 1);
        let events: Vec<(i64, &str, bool)> = e
            .events
            .iter()
            .map(|e| match &e.kind {
                Some(Kind::Request(b)) => (e.time_ns, b.request_id.as_str(), b.start),
                _ => panic!("not a request event"),
            })
            .collect();
        assert_eq!(
            events,
            [
                (10, "a", true),
                (20, "a", false),
                (25, "b", true),
                (30, "c", true),
                (40, "b", false)
            ]
        );
    }

    #[test]
    fn expanding_all_merges_in_time_order_and_keeps_the_thinned_count() {
        let mut s = batch_sample();
        s.requests.as_mut().unwrap().thinned_requests = 9;
        let periodic = |t| pb::Sample {
            time_ns: t,
            ..Default::default()
        };
        let mut samples = vec![periodic(5), s, periodic(50)];
        let mut events = vec![pb::Event {
            time_ns: 22,
            kind: None,
        }];
        expand_all(&mut samples, &mut events);
        let times: Vec<i64> = samples.iter().map(|s| s.time_ns).collect();
        assert_eq!(times, [5, 20, 40, 50]);
        assert_eq!(samples[2].requests.as_ref().unwrap().thinned_requests, 9);
        assert!(samples[2].requests.as_ref().unwrap().readings.is_empty());
        let times: Vec<i64> = events.iter().map(|e| e.time_ns).collect();
        assert_eq!(times, [10, 20, 22, 25, 30, 40]);
    }

    #[test]
    fn an_old_agents_messages_pass_unchanged() {
        let mut samples = vec![pb::Sample {
            time_ns: 3,
            ..Default::default()
        }];
        let before = samples.clone();
        let mut events = Vec::new();
        expand_all(&mut samples, &mut events);
        assert_eq!(samples, before);
        assert!(events.is_empty());
    }
}
