//! `strftime_now(format)` for templates that print today's date (Llama 3.x does).
//!
//! HF's global is `datetime.now().strftime(format)`. This crate must not read the clock itself
//! (`std::time::SystemTime::now` panics on wasm32-unknown-unknown), so the caller supplies the
//! time as Unix seconds (the filter has the host's clock) and this module formats it in UTC
//! with the C-locale directives Python passes to the platform's `strftime`.

use std::fmt::Write as _;

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// A broken-down UTC time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Civil {
    year: i64,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Monday.
    weekday: u32,
    /// 1-based day of the year.
    yday: u32,
}

fn civil(unix_seconds: i64) -> Civil {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    // Howard Hinnant's days-from-civil inverse (public-domain algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative.get(month as usize - 1).copied().unwrap_or(0)
        + day
        + u32::from(leap && month > 2);
    Civil {
        year,
        month,
        day,
        hour: (secs / 3600) as u32,
        minute: (secs % 3600 / 60) as u32,
        second: (secs % 60) as u32,
        // 1970-01-01 was a Thursday (3 with Monday = 0).
        weekday: (days + 3).rem_euclid(7) as u32,
        yday,
    }
}

/// Formats `unix_seconds` (UTC) with a strftime pattern. Supports the directives chat
/// templates use (`%Y %y %m %d %e %H %I %M %S %p %b %B %h %a %A %j %F %T %D %R %n %t %%`, and
/// glibc's `%-d`-style no-padding flag); an unknown directive is an error naming it.
pub fn format(pattern: &str, unix_seconds: i64) -> Result<String, String> {
    let t = civil(unix_seconds);
    let mut out = String::new();
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut directive = chars.next().ok_or("strftime: pattern ends with a lone %")?;
        let pad = if directive == '-' {
            directive = chars.next().ok_or("strftime: pattern ends with %-")?;
            false
        } else {
            true
        };
        let num = |out: &mut String, n: u32, width: usize| {
            let _ = if pad {
                write!(out, "{n:0width$}")
            } else {
                write!(out, "{n}")
            };
        };
        let month_name = MONTHS.get(t.month as usize - 1).copied().unwrap_or("");
        let weekday_name = WEEKDAYS.get(t.weekday as usize).copied().unwrap_or("");
        match directive {
            'Y' => {
                let _ = write!(out, "{}", t.year);
            }
            'y' => num(&mut out, t.year.rem_euclid(100) as u32, 2),
            'm' => num(&mut out, t.month, 2),
            'd' => num(&mut out, t.day, 2),
            'e' => {
                let _ = if pad { write!(out, "{:2}", t.day) } else { write!(out, "{}", t.day) };
            }
            'H' => num(&mut out, t.hour, 2),
            'I' => num(&mut out, if t.hour % 12 == 0 { 12 } else { t.hour % 12 }, 2),
            'M' => num(&mut out, t.minute, 2),
            'S' => num(&mut out, t.second, 2),
            'p' => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            'b' | 'h' => out.push_str(month_name.get(..3).unwrap_or("")),
            'B' => out.push_str(month_name),
            'a' => out.push_str(weekday_name.get(..3).unwrap_or("")),
            'A' => out.push_str(weekday_name),
            'j' => num(&mut out, t.yday, 3),
            'F' => {
                let _ = write!(out, "{}-{:02}-{:02}", t.year, t.month, t.day);
            }
            'T' => {
                let _ = write!(out, "{:02}:{:02}:{:02}", t.hour, t.minute, t.second);
            }
            'R' => {
                let _ = write!(out, "{:02}:{:02}", t.hour, t.minute);
            }
            'D' => {
                let _ = write!(out, "{:02}/{:02}/{:02}", t.month, t.day, t.year.rem_euclid(100));
            }
            'n' => out.push('\n'),
            't' => out.push('\t'),
            '%' => out.push('%'),
            other => return Err(format!("strftime: unsupported directive %{other}; supported: Y y m d e H I M S p b h B a A j F T D R n t %")),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn formats_like_python_utc() {
        // 2024-07-23 14:05:09 UTC, a Tuesday, day 205 of a leap year.
        let t = 1_721_743_509;
        assert_eq!(format("%d %b %Y", t).unwrap(), "23 Jul 2024");
        assert_eq!(
            format("%A %B %-d, %y %H:%M:%S %p %I %j %%", t).unwrap(),
            "Tuesday July 23, 24 14:05:09 PM 02 205 %"
        );
        assert_eq!(format("%F %T", 0).unwrap(), "1970-01-01 00:00:00");
        assert_eq!(format("%a %e", 951_782_400).unwrap(), "Tue 29"); // 2000-02-29
        assert!(format("%Q", t).is_err());
        assert!(format("50%", t).is_err());
    }
}
