//! Recognising an allocation failure in a process's own words (its stderr).

/// True when the text reports a failed memory allocation: Python `MemoryError`,
/// "out of memory" in any case, C++ `std::bad_alloc`, `ENOMEM`,
/// "Cannot allocate memory" (strerror(ENOMEM)), or CUDA error 2
/// (`CUDA_ERROR_OUT_OF_MEMORY`).
pub fn is_oom_text(stderr: &str) -> bool {
    oom_line(stderr).is_some()
}

/// True when the text names a *device* allocation failure: torch's
/// "CUDA out of memory", `CUDA error: out of memory`, CUDA error 2.
pub fn is_cuda_oom_text(stderr: &str) -> bool {
    stderr.lines().any(line_is_cuda_oom)
}

/// The last line that reports an allocation failure (the last is nearest the
/// death), trimmed and bounded so an evidence line stays readable.
pub fn oom_line(stderr: &str) -> Option<String> {
    stderr
        .lines()
        .rev()
        .find(|l| line_is_oom(l))
        .map(|l| clip(l.trim(), 240))
}

/// The last CUDA out-of-memory line, trimmed and bounded.
pub fn cuda_oom_line(stderr: &str) -> Option<String> {
    stderr
        .lines()
        .rev()
        .find(|l| line_is_cuda_oom(l))
        .map(|l| clip(l.trim(), 240))
}

fn line_is_oom(line: &str) -> bool {
    let lower = line.to_ascii_lowercase();
    line.contains("MemoryError")
        || lower.contains("out of memory")
        || line.contains("bad_alloc")
        || has_word(line, "ENOMEM")
        || lower.contains("cannot allocate memory")
        || line_is_cuda_oom(line)
}

fn line_is_cuda_oom(line: &str) -> bool {
    let lower = line.to_ascii_lowercase();
    (lower.contains("cuda") && lower.contains("out of memory"))
        || line.contains("CUDA_ERROR_OUT_OF_MEMORY")
        || line.contains("cudaErrorMemoryAllocation")
        || line.contains("OutOfMemoryError")
        || has_error_code(&lower, "cuda error", 2)
}

/// "cuda error 2" or "cuda error: 2" followed by a non-digit (not "error 20").
fn has_error_code(lower: &str, prefix: &str, code: u32) -> bool {
    let code = code.to_string();
    lower.match_indices(prefix).any(|(i, _)| {
        let rest = lower[i + prefix.len()..].trim_start_matches([' ', ':', '=']);
        rest.strip_prefix(code.as_str())
            .is_some_and(|after| !after.starts_with(|c: char| c.is_ascii_digit()))
    })
}

/// `word` not embedded in a longer identifier.
fn has_word(line: &str, word: &str) -> bool {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    line.match_indices(word).any(|(i, _)| {
        let before_ok = line[..i].chars().next_back().is_none_or(|c| !is_ident(c));
        let after_ok = line[i + word.len()..]
            .chars()
            .next()
            .is_none_or(|c| !is_ident(c));
        before_ok && after_ok
    })
}

fn clip(s: &str, max_chars: usize) -> String {
    if s.chars().count() <= max_chars {
        return s.to_string();
    }
    let mut out: String = s.chars().take(max_chars).collect();
    out.push_str("...");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_allocation_failures_are_recognised() {
        assert!(is_oom_text(
            "Traceback (most recent call last):\nMemoryError\n"
        ));
        assert!(is_oom_text("terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc"));
        assert!(is_oom_text("mmap failed: ENOMEM"));
        assert!(is_oom_text("OSError: [Errno 12] Cannot allocate memory"));
        assert!(is_oom_text("fatal: Out Of Memory"));
        assert!(is_oom_text(
            "runtime: out of memory: cannot allocate 1073741824-byte block"
        ));
    }

    #[test]
    fn cuda_failures_are_recognised() {
        let torch = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total capacity of 139.81 GiB";
        assert!(is_oom_text(torch) && is_cuda_oom_text(torch));
        assert!(is_cuda_oom_text(
            "cuMemAlloc_v2 failed: CUDA_ERROR_OUT_OF_MEMORY"
        ));
        assert!(is_cuda_oom_text("DriverError: CUDA error 2"));
        assert!(is_cuda_oom_text("CUDA error: out of memory"));
        assert!(!is_cuda_oom_text("MemoryError"));
    }

    #[test]
    fn look_alikes_are_not_oom() {
        assert!(!is_oom_text(""));
        assert!(!is_oom_text("CUDA error 20: invalid device"));
        assert!(!is_oom_text("ENOMEMX is not a code; MY_ENOMEM neither"));
        assert!(!is_oom_text("KeyError: 'memory'\nexit status 1"));
    }

    #[test]
    fn the_last_matching_line_is_quoted() {
        let err = "warning: low memory\nMemoryError: first\nstill going\nMemoryError: second\n";
        assert_eq!(oom_line(err).as_deref(), Some("MemoryError: second"));
    }
}
