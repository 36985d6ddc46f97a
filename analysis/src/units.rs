//! How numbers read in evidence lines: bytes with their exact value, times in UTC;
//! and quoted text kept to a length.

/// "64.0 MiB (67108864 bytes)": human-readable, plus the exact count so a reader
/// can compare it with the kernel's files.
pub fn bytes(n: u64) -> String {
    format!("{} ({n} bytes)", bytes_short(n))
}

/// "64.0 MiB", binary units with one decimal.
pub fn bytes_short(n: u64) -> String {
    binary_units(n, 1, "PiB")
}

/// "64.00 MiB", binary units with two decimals, up to TiB: the command line's
/// table columns.
pub fn bytes_table(n: u64) -> String {
    binary_units(n, 2, "TiB")
}

/// "n B" below 1 KiB, else the value in the largest binary unit it reaches (no
/// larger than `top`), with `decimals` places.
fn binary_units(n: u64, decimals: usize, top: &str) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && UNITS[unit] != top && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.decimals$} {}", UNITS[unit])
}

/// Seconds with one decimal, from nanoseconds.
pub fn seconds(ns: i64) -> String {
    format!("{:.1} s", ns as f64 / 1e9)
}

/// Unix epoch nanoseconds as "2026-11-03T10:00:00.123Z" (proleptic Gregorian, UTC).
pub fn time(ns: i64) -> String {
    utc(ns, 'T')
}

/// Unix epoch nanoseconds as "2026-11-03 10:00:00.123Z": [`time`] with a space
/// between date and time, for the command line's tables.
pub fn time_table(ns: i64) -> String {
    utc(ns, ' ')
}

fn utc(ns: i64, sep: char) -> String {
    let secs = ns.div_euclid(1_000_000_000);
    let millis = ns.rem_euclid(1_000_000_000) / 1_000_000;
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}{sep}{:02}:{:02}:{:02}.{millis:03}Z",
        sod / 3600,
        sod % 3600 / 60,
        sod % 60
    )
}

/// Days since 1970-01-01 to (year, month, day); H. Hinnant's algorithm.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// The usual name of a Linux signal number, for evidence lines.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        _ => "signal", // vocab: the word, not IncidentKind::Signal
    }
}

/// `s` cut to `max_chars` characters, with "..." where it was cut: a line
/// quoted from a process's output stays readable in one evidence line.
pub fn clip(s: &str, max_chars: usize) -> String {
    match s.char_indices().nth(max_chars) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_read_in_binary_units_with_the_exact_count() {
        assert_eq!(bytes(67_108_864), "64.0 MiB (67108864 bytes)");
        assert_eq!(bytes(268_435_456), "256.0 MiB (268435456 bytes)");
        assert_eq!(bytes_short(512), "512 B");
        assert_eq!(bytes_short(1536), "1.5 KiB");
        assert_eq!(bytes_short(150_100_000_000), "139.8 GiB");
        assert_eq!(bytes_short(3 << 50), "3.0 PiB");
    }

    #[test]
    fn table_bytes_have_two_decimals_up_to_tib() {
        assert_eq!(bytes_table(512), "512 B");
        assert_eq!(bytes_table(64 << 20), "64.00 MiB");
        assert_eq!(bytes_table(1_256_194_048), "1.17 GiB");
        assert_eq!(bytes_table(3 << 50), "3072.00 TiB");
    }

    #[test]
    fn times_are_utc() {
        assert_eq!(time(0), "1970-01-01T00:00:00.000Z");
        // 2026-11-03T10:00:00.250Z
        assert_eq!(time(1_793_700_000_250_000_000), "2026-11-03T10:00:00.250Z");
        assert_eq!(time(951_782_400_000_000_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(
            time_table(1_793_700_000_250_000_000),
            "2026-11-03 10:00:00.250Z"
        );
    }
}
