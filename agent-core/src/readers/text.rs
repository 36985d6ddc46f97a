//! Small helpers shared by the parsers: tolerant file reads and number parsing.

use std::path::Path;

/// The file's text, or None when it is missing or unreadable (never an error:
/// the caller marks the reading partial instead).
pub(crate) fn read_opt(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// [`read_opt`] of `name` in the open directory `dir`: opened relative to
/// it, so the kernel walks one path component, not the whole path (for a
/// small cgroup file the walk is most of the read), and read without the
/// size query `fs::read_to_string` makes (a pseudo-file's size says nothing).
pub(crate) fn read_at(dir: &std::fs::File, name: &str) -> Option<String> {
    use std::io::Read;
    let file = open_at(dir, name)?;
    let mut text = String::new();
    // Through `Take`: its read_to_string asks no size of the file.
    (&file).take(u64::MAX).read_to_string(&mut text).ok()?;
    Some(text)
}

/// `name` in the open directory `dir`, opened read-only relative to it.
pub(crate) fn open_at(dir: &std::fs::File, name: &str) -> Option<std::fs::File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let name = std::ffi::CString::new(name).ok()?;
    // SAFETY: a valid directory fd and a NUL-terminated name; the fd
    // returned is owned by the File from here on.
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            name.as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    (fd >= 0).then(|| unsafe { std::fs::File::from_raw_fd(fd) })
}

/// The first read of a file held open: room for any counter file (the
/// largest, v2 `memory.events`, is under 100 bytes); a longer text grows it.
const PREAD_START: usize = 512;

/// The whole text of `file`, held open, read from offset 0: one `pread` for
/// a small file. A cgroup file (kernfs' seq_file) makes its text afresh for
/// each read from its start, so a watcher keeps the file open instead of
/// opening and closing it at every reading. A short read is the end: a
/// seq_file gives all it has up to the size asked.
pub(crate) fn pread_text(file: &std::fs::File) -> Option<String> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; PREAD_START];
    let mut len = 0;
    loop {
        let n = file.read_at(&mut buf[len..], len as u64).ok()?;
        len += n;
        if n == 0 || len < buf.len() {
            break;
        }
        buf.resize(buf.len() * 2, 0);
    }
    buf.truncate(len);
    String::from_utf8(buf).ok()
}

/// The first whitespace-separated token of `text` as u64.
pub(crate) fn first_u64(text: &str) -> Option<u64> {
    text.split_whitespace().next()?.parse().ok()
}

/// Iterates `key value` lines (memory.stat, memory.events, vmstat, oom_control);
/// lines that do not have that shape are skipped.
pub(crate) fn key_values(text: &str) -> impl Iterator<Item = (&str, u64)> {
    text.lines().filter_map(|line| {
        let mut it = line.split_whitespace();
        let key = it.next()?;
        let value = it.next()?.parse().ok()?;
        Some((key, value))
    })
}

/// The value of `Key:   1234 kB` in bytes (meminfo, status). Lines without a
/// unit are taken as plain counts.
pub(crate) fn kb_line_bytes(rest: &str) -> Option<u64> {
    let mut it = rest.split_whitespace();
    let n: u64 = it.next()?.parse().ok()?;
    match it.next() {
        Some(unit) if unit.eq_ignore_ascii_case("kb") => Some(n.saturating_mul(1024)),
        Some(_) => None,
        None => Some(n),
    }
}
