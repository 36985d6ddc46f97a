//! The numbers in PyTorch's CUDA out-of-memory message, for when the event
//! lacks them (or to cross-check them):
//!
//! "CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total
//! capacity of 139.80 GiB of which 137.33 GiB is free. Process 444 has 134.79
//! GiB memory in use. Including non-PyTorch memory, this process has 2.46 GiB
//! memory in use. 2.00 GiB allowed; Of the allocated memory 800.00 MiB is
//! allocated by PyTorch, and 1.17 GiB is reserved by PyTorch but unallocated."
//!
//! Under `backend:cudaMallocAsync` PyTorch words it differently
//! (c10/cuda/CUDAMallocAsyncAllocator.cpp, `mallocAsync`):
//!
//! "Allocation on device 0 would exceed allowed memory. (out of memory)
//! Currently allocated     : 9.43 GiB
//! Requested               : 640.00 MiB
//! Device limit            : 11.59 GiB
//! Free (according to CUDA): 7.12 MiB
//! PyTorch limit (set by user-supplied memory fraction)
//!                         : 17179869184.00 GiB"
//!
//! "Currently allocated" is what PyTorch has handed out; the pool's reserved
//! bytes are not in it. Without a memory fraction the limit is UINT64_MAX.
//!
//! The message rounds to two decimals, so these are approximate.

/// What the message says, each part where present.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TorchOomText {
    pub requested_bytes: Option<u64>,
    pub total_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    /// The per-process cap ("X allowed").
    pub allowed_bytes: Option<u64>,
    pub allocated_bytes: Option<u64>,
    pub reserved_unallocated_bytes: Option<u64>,
    /// This process, non-PyTorch memory included.
    pub process_bytes: Option<u64>,
    /// The message has the "this process has" line: PyTorch found its own
    /// pid among NVML's, so NVML's pids are in this process's namespace.
    pub names_this_process: bool,
    /// Other processes as NVML reports them: (pid, bytes), the bytes None
    /// where NVML could not give them.
    pub others: Vec<(u32, Option<u64>)>,
    /// The failing device's ordinal in the process ("GPU 2 has a total
    /// capacity"); None when absent, or when the text names several.
    pub ordinal: Option<i32>,
    /// The message is cudaMallocAsync's: that backend keeps no segments,
    /// splits or retries.
    pub cuda_malloc_async: bool,
}

/// The words that open cudaMallocAsync's out-of-memory message.
const ASYNC_FORM: &str = "would exceed allowed memory";

pub fn parse(text: &str) -> TorchOomText {
    if let Some(i) = text.find(ASYNC_FORM) {
        return TorchOomText {
            ordinal: ordinal(text),
            ..parse_async(&text[i..])
        };
    }
    let mut t = TorchOomText {
        requested_bytes: size_after(text, "Tried to allocate "),
        allowed_bytes: size_before(text, " allowed"),
        allocated_bytes: size_before(text, " is allocated by PyTorch"),
        reserved_unallocated_bytes: size_before(text, " is reserved by PyTorch but unallocated"),
        process_bytes: size_after(text, "this process has ").and_then(usage),
        names_this_process: text.contains("this process has "),
        ordinal: ordinal(text),
        ..Default::default()
    };
    if let Some(i) = text.find("total capacity of ") {
        let rest = &text[i + "total capacity of ".len()..];
        t.total_bytes = leading_size(rest).map(|(b, _)| b);
        t.free_bytes = size_after(rest, "of which ");
    }
    let mut rest = text;
    while let Some(i) = rest.find("Process ") {
        rest = &rest[i + "Process ".len()..];
        let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        let Ok(pid) = digits.parse::<u32>() else {
            continue;
        };
        if let Some(bytes) = rest[digits.len()..]
            .strip_prefix(" has ")
            .and_then(leading_size)
            .map(|(b, _)| b)
        {
            t.others.push((pid, usage(bytes)));
        }
    }
    t
}

/// NVML answers "not available" (per-process usage under MIG, in some
/// containers) with all ones, which PyTorch prints as "17179869184.00 GiB":
/// no device holds an exbibyte, so such a figure is unknown.
fn usage(bytes: u64) -> Option<u64> {
    (bytes < 1 << 60).then_some(bytes)
}

/// The failing device's ordinal in the process, where every phrase naming
/// one agrees: the caching allocator's "GPU N has a total capacity",
/// cudaMallocAsync's "Allocation on device N would exceed allowed memory".
pub fn ordinal(text: &str) -> Option<i32> {
    const MARKS: [(&str, &str); 2] = [
        ("GPU ", " has a total capacity"),
        ("on device ", " would exceed allowed memory"),
    ];
    let mut found = MARKS.iter().flat_map(|&(before, after)| {
        text.match_indices(before).filter_map(move |(i, m)| {
            let rest = &text[i + m.len()..];
            let digits = rest.len() - rest.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            (digits > 0 && rest[digits..].starts_with(after))
                .then(|| rest[..digits].parse::<i32>().ok())
                .flatten()
        })
    });
    let first = found.next()?;
    found.all(|n| n == first).then_some(first)
}

/// cudaMallocAsync's message, from its opening words on.
fn parse_async(text: &str) -> TorchOomText {
    let total_bytes = field(text, "Device limit");
    // UINT64_MAX (no memory fraction) or the whole device is no cap.
    let allowed_bytes = field(text, "PyTorch limit (set by user-supplied memory fraction)")
        .filter(|&l| l < total_bytes.unwrap_or(u64::MAX) && l < 1 << 62);
    TorchOomText {
        requested_bytes: field(text, "Requested"),
        total_bytes,
        free_bytes: field(text, "Free (according to CUDA)"),
        allowed_bytes,
        allocated_bytes: field(text, "Currently allocated"),
        cuda_malloc_async: true,
        ..Default::default()
    }
}

/// The size in "Label     : 1.00 GiB" (the colon may follow a line break).
fn field(text: &str, label: &str) -> Option<u64> {
    let i = text.find(label)?;
    let rest = text[i + label.len()..].trim_start().strip_prefix(':')?;
    leading_size(rest).map(|(b, _)| b)
}

fn size_after(text: &str, marker: &str) -> Option<u64> {
    let i = text.find(marker)?;
    leading_size(&text[i + marker.len()..]).map(|(b, _)| b)
}

/// The size that ends right before `marker` ("1.17 GiB" in "1.17 GiB is ...").
fn size_before(text: &str, marker: &str) -> Option<u64> {
    let head = &text[..text.find(marker)?];
    let mut words = head.split_whitespace().rev();
    let unit = words.next()?;
    let number = words.next()?.trim_start_matches([';', ',', '(']);
    leading_size(&format!("{number} {unit}")).map(|(b, _)| b)
}

/// "96.00 MiB..." -> bytes and the rest after the unit.
fn leading_size(s: &str) -> Option<(u64, &str)> {
    let s = s.trim_start();
    let num_len = s
        .char_indices()
        .find(|(_, c)| !(c.is_ascii_digit() || *c == '.'))
        .map_or(s.len(), |(i, _)| i);
    let value: f64 = s[..num_len].trim_end_matches('.').parse().ok()?;
    let rest = s[num_len..].trim_start();
    let (scale, unit_len) = [
        ("bytes", 1u64),
        ("KiB", 1 << 10),
        ("MiB", 1 << 20),
        ("GiB", 1 << 30),
        ("TiB", 1 << 40),
        ("B", 1),
    ]
    .iter()
    .find(|(u, _)| rest.starts_with(u))
    .map(|(u, scale)| (*scale, u.len()))?;
    Some(((value * scale as f64).round() as u64, &rest[unit_len..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    #[test]
    fn the_capped_message_reads_in_full() {
        let t = parse("CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which 137.33 GiB is free. Including non-PyTorch memory, this process has 2.46 GiB memory in use. 2.00 GiB allowed; Of the allocated memory 800.00 MiB is allocated by PyTorch, and 1.17 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF");
        assert_eq!(t.requested_bytes, Some(96 * MIB));
        assert_eq!(t.allowed_bytes, Some(2 * GIB));
        assert_eq!(t.allocated_bytes, Some(800 * MIB));
        assert_eq!(
            t.reserved_unallocated_bytes,
            Some((1.17 * GIB as f64).round() as u64)
        );
        assert_eq!(t.total_bytes, Some((139.80 * GIB as f64).round() as u64));
        assert_eq!(t.free_bytes, Some((137.33 * GIB as f64).round() as u64));
        assert_eq!(t.process_bytes, Some((2.46 * GIB as f64).round() as u64));
        assert!(t.others.is_empty());
    }

    #[test]
    fn other_processes_and_zero_bytes_are_read() {
        let t = parse("Tried to allocate 512.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which 499.56 MiB is free. Including non-PyTorch memory, this process has 4.51 GiB memory in use. Process 444 has 134.79 GiB memory in use. Of the allocated memory 4.00 GiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated.");
        assert_eq!(
            t.others,
            vec![(444, Some((134.79 * GIB as f64).round() as u64))]
        );
        assert!(t.names_this_process);
        assert_eq!(t.ordinal, Some(0));
        assert_eq!(t.reserved_unallocated_bytes, Some(0));
        assert_eq!(t.allocated_bytes, Some(4 * GIB));
        assert_eq!(t.allowed_bytes, None);
    }

    #[test]
    fn the_ordinal_and_nvmls_unavailable_usage_are_read() {
        // PyTorch's text in a container on GPU 2, NVML's usage not available
        // (all ones, printed as an exbibyte-sized figure).
        let t = parse("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 2 has a total capacity of 79.19 GiB of which 1.06 GiB is free. Process 3141592 has 17179869184.00 GiB memory in use. Of the allocated memory 71.50 GiB is allocated by PyTorch, and 6.02 GiB is reserved by PyTorch but unallocated.");
        assert_eq!(t.ordinal, Some(2));
        assert_eq!(t.others, vec![(3141592, None)]);
        assert!(!t.names_this_process);
        assert_eq!(t.process_bytes, None);
        // Two workers' texts naming different devices name no one device.
        let two = "GPU 0 has a total capacity of 79.19 GiB of which 1.00 GiB is free.\nGPU 1 has a total capacity of 79.19 GiB of which 1.00 GiB is free.";
        assert_eq!(parse(two).ordinal, None);
        // A driver error names no device; "GPU 0" elsewhere is not the ordinal.
        assert_eq!(ordinal("CUDA error: out of memory"), None);
        assert_eq!(ordinal("GPU 0 is busy"), None);
        assert_eq!(
            ordinal("Allocation on device 12 would exceed allowed memory. (out of memory)"),
            Some(12)
        );
    }

    #[test]
    fn cuda_malloc_async_words_are_read() {
        // As PyTorch raises it under backend:cudaMallocAsync (the order and
        // the padding of c10/cuda/CUDAMallocAsyncAllocator.cpp).
        let t = parse("torch.OutOfMemoryError: Allocation on device 0 would exceed allowed memory. (out of memory)\nCurrently allocated     : 9.43 GiB\nRequested               : 640.00 MiB\nDevice limit            : 11.59 GiB\nFree (according to CUDA): 7.12 MiB\nPyTorch limit (set by user-supplied memory fraction)\n                        : 17179869184.00 GiB");
        assert!(t.cuda_malloc_async);
        assert_eq!(t.ordinal, Some(0), "the async form names its device too");
        assert_eq!(t.requested_bytes, Some(640 * MIB));
        assert_eq!(t.allocated_bytes, Some((9.43 * GIB as f64).round() as u64));
        assert_eq!(t.total_bytes, Some((11.59 * GIB as f64).round() as u64));
        assert_eq!(t.free_bytes, Some((7.12 * MIB as f64).round() as u64));
        assert_eq!(t.allowed_bytes, None, "UINT64_MAX is no cap");
        assert_eq!(t.reserved_unallocated_bytes, None, "not in this message");
        assert_eq!(t.process_bytes, None);
        // A memory fraction of 0.5 is a cap.
        let capped = parse("Allocation on device 1 would exceed allowed memory. (out of memory)\nCurrently allocated     : 39.00 GiB\nRequested               : 2.00 GiB\nDevice limit            : 79.25 GiB\nFree (according to CUDA): 38.00 GiB\nPyTorch limit (set by user-supplied memory fraction)\n                        : 39.62 GiB");
        assert_eq!(
            capped.allowed_bytes,
            Some((39.62 * GIB as f64).round() as u64)
        );
        assert_eq!(capped.requested_bytes, Some(2 * GIB));
    }

    #[test]
    fn other_text_reads_as_nothing() {
        assert_eq!(parse("MemoryError"), TorchOomText::default());
        assert_eq!(parse("Process abc has 3 GiB"), TorchOomText::default());
    }
}
