//! Host readings that count at their peak before the death: Committed_AS
//! and /dev/shm use. A reading taken after the child ended shows what it
//! held already given back (its commit released, its segments unlinked), so
//! it is context, never the figure a verdict rests on.

use crate::evidence::Evidence;
use crate::pb;
use crate::units::seconds;

/// One figure against its bound, at its highest before the death.
#[derive(Clone, Debug, PartialEq)]
pub struct PeakReading {
    pub used: u64,
    /// The bound it is measured against (CommitLimit, the tmpfs size).
    pub bound: u64,
    /// Where the figure comes from, for people.
    pub label: String,
    /// The reading after the death, where one was taken and the peak is
    /// from the samples before it.
    pub after: Option<u64>,
}

impl PeakReading {
    pub fn share(&self) -> f64 {
        self.used as f64 / self.bound as f64
    }
}

/// Committed_AS against CommitLimit, with the overcommit mode in force.
pub fn commit(e: &Evidence) -> Option<(PeakReading, i32)> {
    let mode = e.last_system().map_or(0, |s| s.overcommit_mode);
    let peak = peak(e, |s| {
        (s.commit_limit_bytes > 0).then_some((s.committed_as_bytes, s.commit_limit_bytes))
    })?;
    Some((peak, mode))
}

/// /dev/shm used against its size.
pub fn shm(e: &Evidence) -> Option<PeakReading> {
    peak(e, |s| {
        (s.shm_total_bytes > 0).then_some((s.shm_used_bytes, s.shm_total_bytes))
    })
}

/// The highest reading among the samples before the death, else the one
/// taken after it (so labelled).
fn peak(
    e: &Evidence,
    pick: impl Fn(&pb::SystemMemory) -> Option<(u64, u64)>,
) -> Option<PeakReading> {
    let death = e.death_time();
    let after = e
        .child_exit()
        .and_then(|(_, x)| x.after.as_ref())
        .and_then(|c| c.system.as_ref())
        .and_then(&pick);
    let before: Vec<(i64, (u64, u64))> = e
        .samples
        .iter()
        .filter(|s| death.is_none_or(|d| s.time_ns < d))
        .filter_map(|s| s.system.as_ref().and_then(&pick).map(|r| (s.time_ns, r)))
        .collect();
    let Some(&(t, (used, bound))) = before.iter().max_by_key(|(t, (u, _))| (*u, *t)) else {
        let (used, bound) = after?;
        return Some(PeakReading {
            used,
            bound,
            label: "read after the death; no sample before it".to_string(),
            after: None,
        });
    };
    let label = match death {
        Some(d) => format!(
            "the peak of {} sample{} before the death, {} before it",
            before.len(),
            if before.len() == 1 { "" } else { "s" },
            seconds(d - t)
        ),
        None => format!("the peak of {} samples", before.len()),
    };
    Some(PeakReading {
        used,
        bound,
        label,
        after: after.map(|(u, _)| u),
    })
}

/// The size of the request that failed, where the text gives it: "failed
/// to allocate 1073741824 bytes", "Unable to allocate 7.45 GiB for an
/// array", "cannot allocate 1073741824-byte block", "CPU buffer of size N".
/// The last line that gives one speaks (it is nearest the death).
pub fn requested_bytes(stderr: &str) -> Option<u64> {
    stderr.lines().rev().find_map(line_request)
}

fn line_request(line: &str) -> Option<u64> {
    let lower = line.to_ascii_lowercase();
    let words: Vec<&str> = lower.split_whitespace().collect();
    let at = words.iter().position(|w| w.starts_with("allocat"))?;
    let rest = &words[at + 1..words.len().min(at + 8)];
    for (i, w) in rest.iter().enumerate() {
        let w = w.trim_matches(|c: char| matches!(c, '(' | ')' | ',' | ':' | ';'));
        if let Some(n) = w.strip_suffix("-byte") {
            return n.parse().ok();
        }
        let Ok(n) = w.parse::<f64>() else { continue };
        let unit = rest
            .get(i + 1)
            .map(|u| u.trim_matches(|c: char| !c.is_ascii_alphabetic()));
        let scale = match unit {
            Some("b" | "byte" | "bytes") => 1.0,
            Some("kb" | "kib") => 1024.0,
            Some("mb" | "mib") => 1024.0 * 1024.0,
            Some("gb" | "gib") => 1024.0 * 1024.0 * 1024.0,
            Some("tb" | "tib") => 1024.0 * 1024.0 * 1024.0 * 1024.0,
            // "of size N": llama.cpp's bytes.
            _ if i > 0 && rest[i - 1] == "size" => 1.0,
            _ => continue,
        };
        return Some((n * scale).round() as u64);
    }
    None
}

/// The process that wrote to /dev/shm, where the text names it: the pid in
/// a PyTorch segment's name (`/torch_<pid>_<n>_<n>`, its creator), or the
/// DataLoader worker that died ("DataLoader worker (pid 4012)", "(pid(s) 81, 82)").
pub fn shm_writer(line: &str) -> Option<u32> {
    let after = |marker: &str| {
        let i = line.find(marker)?;
        let digits: String = line[i + marker.len()..]
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        digits.parse().ok().filter(|&p: &u32| p > 0)
    };
    after("/torch_")
        .or_else(|| after("worker (pid(s)"))
        .or_else(|| after("worker (pid"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_read_in_their_units() {
        assert_eq!(
            requested_bytes("RuntimeError: failed to allocate 1073741824 bytes"),
            Some(1 << 30)
        );
        assert_eq!(
            requested_bytes("numpy.core._exceptions._ArrayMemoryError: Unable to allocate 1.50 GiB for an array with shape (201326592,) and data type float64"),
            Some(1610612736)
        );
        assert_eq!(
            requested_bytes(
                "runtime: out of memory: cannot allocate 4194304-byte block (3997696 in use)"
            ),
            Some(4194304)
        );
        assert_eq!(
            requested_bytes(
                "alloc_tensor_range: failed to allocate CPU buffer of size 37748736000"
            ),
            Some(37748736000)
        );
        assert_eq!(requested_bytes("Traceback\nMemoryError\n"), None);
        assert_eq!(requested_bytes("failed to allocate CUDA0 buffer"), None);
    }

    #[test]
    fn a_torch_segment_or_a_dataloader_worker_names_the_writer() {
        assert_eq!(
            shm_writer("unable to allocate shared memory(shm) for file </torch_4012_3046393498_0>: No space"),
            Some(4012)
        );
        assert_eq!(shm_writer("No space left on device: '/dev/shm/x'"), None);
        assert_eq!(
            shm_writer(
                "RuntimeError: DataLoader worker (pid 4012) is killed by signal: Bus error."
            ),
            Some(4012)
        );
        assert_eq!(
            shm_writer(
                "RuntimeError: DataLoader worker (pid(s) 81, 82) is killed by signal: Bus error."
            ),
            Some(81)
        );
    }
}
