//! PVE's calendar events: the `schedule` of a backup job (`/etc/pve/jobs.cfg`), parsed and its
//! next start computed as PVE's scheduler does (tests/data/pve-jobs-facts.md, "Schedules").
//!
//! The format (pve-common `src/PVE/CalendarEvent.pm` hands it to `Proxmox::RS::CalendarEvent`,
//! the `proxmox-time` crate; documented as "Calendar Events"):
//! `[WEEKDAY] [[YEARS-]MONTHS-DAYS] [HOURS:MINUTES[:SECONDS]] [UTC]`, at least one of the
//! first three parts. Weekdays `mon`..`sun` (or their full names, any case), as lists (`,`)
//! and ranges (`..`, Monday first: `sat..sun` is valid, `fri..mon` is not). Every other field
//! is a list of `N`, `N..M`, `N/R` (from N every R), `N..M/R`, `*` or `*/R`. A time of one
//! field is its minutes (every hour); an omitted time is `00:00:00`; omitted seconds are 0.
//! The special words `minutely`, `hourly`, `daily`, `weekly`, `monthly`, `yearly` (or
//! `annually`), `quarterly` and `semiannually` (or `semi-annually`) stand for their events.
//! Times are the node's local time unless the event ends in `UTC`.
//!
//! [`CalendarEvent::next_after`] is `compute_next_event`: the first matching second strictly
//! after `last`. pve-manager `PVE/Jobs.pm` `run_jobs` starts a job once the next event after
//! its last run time has come.
//!
//! Pure but for the local time zone (the node's `TZ` or `/etc/localtime`, read by `jiff` as
//! pvescheduler's libc reads it); never panics on any input.

use std::fmt;

/// One element of a field's list.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Value {
    /// `N`.
    Single(u32),
    /// `N..M`.
    Range(u32, u32),
    /// `N/R`, `N..M/R`, `*/R`: from N every R, up to M (or the field's end).
    Every { start: u32, step: u32, end: u32 },
}

impl Value {
    fn contains(&self, v: u32) -> bool {
        match *self {
            Value::Single(s) => s == v,
            Value::Range(a, b) => a <= v && v <= b,
            Value::Every { start, step, end } => {
                v >= start && v <= end && step > 0 && (v - start).is_multiple_of(step)
            }
        }
    }
}

/// A field: `None` is `*` (every value).
type Field = Option<Vec<Value>>;

fn matches(field: &Field, v: u32) -> bool {
    field
        .as_ref()
        .is_none_or(|list| list.iter().any(|x| x.contains(v)))
}

/// Why a schedule does not parse (PVE refuses the same text with a message of its own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError(String);

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ParseError {}

fn err<T>(msg: impl Into<String>) -> Result<T, ParseError> {
    Err(ParseError(msg.into()))
}

/// A parsed calendar event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalendarEvent {
    /// `UTC` at the end: the fields are UTC, not the node's local time.
    pub utc: bool,
    /// Bit 0 Monday … bit 6 Sunday; 0: every day.
    weekdays: u8,
    years: Field,
    months: Field,
    days: Field,
    hours: Field,
    minutes: Field,
    seconds: Field,
}

/// Which clock [`CalendarEvent::next_after_in`] reads the fields in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Zone {
    /// UTC.
    Utc,
    /// The process's local time zone (`TZ`, else `/etc/localtime`), as pvescheduler's.
    Local,
}

const WEEKDAYS: [(&str, &str); 7] = [
    ("mon", "monday"),
    ("tue", "tuesday"),
    ("wed", "wednesday"),
    ("thu", "thursday"),
    ("fri", "friday"),
    ("sat", "saturday"),
    ("sun", "sunday"),
];

fn weekday(name: &str) -> Option<u8> {
    let lower = name.to_ascii_lowercase();
    WEEKDAYS
        .iter()
        .position(|(short, long)| lower == *short || lower == *long)
        .and_then(|i| u8::try_from(i).ok())
}

fn parse_weekdays(text: &str) -> Result<u8, ParseError> {
    let mut bits = 0u8;
    for part in text.split(',') {
        if let Some((a, b)) = part.split_once("..") {
            let (Some(a), Some(b)) = (weekday(a), weekday(b)) else {
                return err(format!("invalid weekday range '{part}'"));
            };
            if b < a {
                return err(format!("wrong order in range '{part}'"));
            }
            for d in a..=b {
                bits |= 1 << d;
            }
        } else {
            let Some(d) = weekday(part) else {
                return err(format!("invalid weekday '{part}'"));
            };
            bits |= 1 << d;
        }
    }
    Ok(bits)
}

fn number(text: &str, what: &str, min: u32, max: u32) -> Result<u32, ParseError> {
    if text.is_empty() || text.len() > 4 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return err(format!("invalid {what} '{text}'"));
    }
    let v: u32 = text
        .parse()
        .map_err(|_| ParseError(format!("invalid {what} '{text}'")))?;
    if v < min || v > max {
        return err(format!("{what} '{v}' out of range"));
    }
    Ok(v)
}

/// A field's list; `min..=max` its values. `*` alone is `None`.
fn parse_field(text: &str, min: u32, max: u32) -> Result<Field, ParseError> {
    if text == "*" {
        return Ok(None);
    }
    let mut list = Vec::new();
    for part in text.split(',') {
        let (base, step) = match part.split_once('/') {
            Some((b, r)) => {
                let r = number(r, "repetition", 0, max)?;
                if r == 0 {
                    return err(format!("repetition '{r}' out of range"));
                }
                (b, Some(r))
            }
            None => (part, None),
        };
        let (start, end) = if base == "*" {
            if step.is_none() {
                return err(format!("invalid value '{part}'"));
            }
            (min, max)
        } else if let Some((a, b)) = base.split_once("..") {
            let a = number(a, "value", min, max)?;
            let b = number(b, "range end", min, max)?;
            if b < a {
                return err(format!("wrong order in range '{base}'"));
            }
            (a, b)
        } else {
            let v = number(base, "value", min, max)?;
            (v, if step.is_some() { max } else { v })
        };
        list.push(match step {
            Some(step) => Value::Every { start, step, end },
            None if start == end => Value::Single(start),
            None => Value::Range(start, end),
        });
    }
    Ok(Some(list))
}

fn single(v: u32) -> Field {
    Some(vec![Value::Single(v)])
}

impl CalendarEvent {
    fn midnight() -> Self {
        CalendarEvent {
            utc: false,
            weekdays: 0,
            years: None,
            months: None,
            days: None,
            hours: single(0),
            minutes: single(0),
            seconds: single(0),
        }
    }

    /// Parses `text` as PVE does.
    pub fn parse(text: &str) -> Result<Self, ParseError> {
        let mut text = text.trim();
        if text.is_empty() {
            return err("event is empty");
        }
        let mut utc = false;
        if let Some(head) = text.strip_suffix("UTC") {
            if head.is_empty() || head.ends_with(char::is_whitespace) {
                utc = true;
                text = head.trim_end();
            }
        }
        let special = match text.to_ascii_lowercase().as_str() {
            "minutely" => Some(CalendarEvent {
                hours: None,
                minutes: None,
                ..Self::midnight()
            }),
            "hourly" => Some(CalendarEvent {
                hours: None,
                ..Self::midnight()
            }),
            "daily" => Some(Self::midnight()),
            "weekly" => Some(CalendarEvent {
                weekdays: 1,
                ..Self::midnight()
            }),
            "monthly" => Some(CalendarEvent {
                days: single(1),
                ..Self::midnight()
            }),
            "yearly" | "annually" => Some(CalendarEvent {
                months: single(1),
                days: single(1),
                ..Self::midnight()
            }),
            "quarterly" => Some(CalendarEvent {
                months: Some(vec![1, 4, 7, 10].into_iter().map(Value::Single).collect()),
                days: single(1),
                ..Self::midnight()
            }),
            "semiannually" | "semi-annually" => Some(CalendarEvent {
                months: Some(vec![Value::Single(1), Value::Single(7)]),
                days: single(1),
                ..Self::midnight()
            }),
            _ => None,
        };
        if let Some(mut ev) = special {
            ev.utc = utc;
            return Ok(ev);
        }
        if text.is_empty() {
            return err("event is empty");
        }
        let mut ev = Self::midnight();
        ev.utc = utc;
        let mut parts = text.split_whitespace().peekable();
        let mut any = false;
        if let Some(first) = parts.peek() {
            if first.starts_with(|c: char| c.is_ascii_alphabetic()) {
                ev.weekdays = parse_weekdays(first)?;
                parts.next();
                any = true;
            }
        }
        if let Some(date) = parts.peek().filter(|p| p.contains('-')) {
            let fields: Vec<&str> = date.split('-').collect();
            let (y, m, d) = match fields.as_slice() {
                [m, d] => (None, *m, *d),
                [y, m, d] => (Some(*y), *m, *d),
                _ => return err(format!("invalid date '{date}'")),
            };
            if let Some(y) = y {
                ev.years = parse_field(y, 1970, 9999)?;
            }
            ev.months = parse_field(m, 1, 12)?;
            ev.days = parse_field(d, 1, 31)?;
            parts.next();
            any = true;
        }
        if let Some(time) = parts.next() {
            let fields: Vec<&str> = time.split(':').collect();
            match fields.as_slice() {
                [m] => {
                    ev.hours = None;
                    ev.minutes = parse_field(m, 0, 59)?;
                }
                [h, m] => {
                    ev.hours = parse_field(h, 0, 23)?;
                    ev.minutes = parse_field(m, 0, 59)?;
                }
                [h, m, s] => {
                    ev.hours = parse_field(h, 0, 23)?;
                    ev.minutes = parse_field(m, 0, 59)?;
                    ev.seconds = parse_field(s, 0, 59)?;
                }
                _ => return err(format!("invalid time '{time}'")),
            }
            any = true;
        }
        if parts.next().is_some() {
            return err("unused parts");
        }
        if !any {
            return err("event is empty");
        }
        Ok(ev)
    }

    /// The first second strictly after `last` (a Unix time) the event matches, in the event's
    /// own zone (`UTC` at its end, else the node's local time); `None` when none comes (a date
    /// in the past).
    pub fn next_after(&self, last: i64) -> Option<i64> {
        self.next_after_in(last, if self.utc { Zone::Utc } else { Zone::Local })
    }

    /// [`Self::next_after`] with the zone given.
    pub fn next_after_in(&self, last: i64, zone: Zone) -> Option<i64> {
        let tz = match zone {
            Zone::Utc => jiff::tz::TimeZone::UTC,
            Zone::Local => jiff::tz::TimeZone::system(),
        };
        self.next_in(last, &tz)
    }

    fn next_in(&self, last: i64, tz: &jiff::tz::TimeZone) -> Option<i64> {
        let from = last.checked_add(1)?;
        let (fy, fm, fd) = civil_of(from, tz)?;
        let first_day = days_from_civil(fy, fm, fd);
        // One Gregorian cycle: after it, every date and weekday repeats.
        for offset in 0..146_097 {
            let day = first_day + offset;
            let date = civil_from_days(day);
            // 1970-01-01 was a Thursday: 0 is Monday.
            let wday = u8::try_from((day + 3).rem_euclid(7)).ok()?;
            let (Ok(y), Ok(m), Ok(d)) = (
                u32::try_from(date.0),
                u32::try_from(date.1),
                u32::try_from(date.2),
            ) else {
                return None;
            };
            if y > 9999 {
                return None;
            }
            if (self.weekdays != 0 && self.weekdays & (1 << wday) == 0)
                || !matches(&self.years, y)
                || !matches(&self.months, m)
                || !matches(&self.days, d)
            {
                continue;
            }
            // Hours and minutes that end before `from` are skipped whole.
            for h in (0..24).filter(|h| matches(&self.hours, *h)) {
                if epoch(tz, date, h, 59, 59)? < from {
                    continue;
                }
                for mi in (0..60).filter(|mi| matches(&self.minutes, *mi)) {
                    if epoch(tz, date, h, mi, 59)? < from {
                        continue;
                    }
                    for s in (0..60).filter(|s| matches(&self.seconds, *s)) {
                        let t = epoch(tz, date, h, mi, s)?;
                        if t >= from {
                            return Some(t);
                        }
                    }
                }
            }
        }
        None
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (
        if m <= 2 {
            yoe + era * 400 + 1
        } else {
            yoe + era * 400
        },
        m,
        d,
    )
}

/// The calendar date of Unix time `t` in `tz`.
fn civil_of(t: i64, tz: &jiff::tz::TimeZone) -> Option<(i64, i64, i64)> {
    let dt = tz.to_datetime(jiff::Timestamp::from_second(t).ok()?);
    Some((
        i64::from(dt.year()),
        i64::from(dt.month()),
        i64::from(dt.day()),
    ))
}

/// The Unix time of a date and time in `tz`. A local time a DST change skips is moved
/// forward by the change, and one it repeats is its first instance, as the node's clock
/// (libc's `mktime`) has them.
fn epoch(
    tz: &jiff::tz::TimeZone,
    (y, m, d): (i64, i64, i64),
    h: u32,
    mi: u32,
    s: u32,
) -> Option<i64> {
    let dt = jiff::civil::DateTime::new(
        i16::try_from(y).ok()?,
        i8::try_from(m).ok()?,
        i8::try_from(d).ok()?,
        i8::try_from(h).ok()?,
        i8::try_from(mi).ok()?,
        i8::try_from(s).ok()?,
        0,
    )
    .ok()?;
    Some(
        tz.to_ambiguous_zoned(dt)
            .compatible()
            .ok()?
            .timestamp()
            .as_second(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// pve-common `test/calendar_event_test.pl`: the events it parses and the next event it
    /// expects after each time (UTC), and the texts it refuses (tests/data/pve-jobs-facts.md).
    #[test]
    fn pve_commons_own_cases() {
        let cases: &[(&str, &[(i64, i64)])] = &[
            ("*", &[(0, 60), (30, 60), (59, 60), (60, 120)]),
            (
                "*/10",
                &[(0, 600), (599, 600), (600, 1200), (50 * 60, 3600)],
            ),
            ("*/12:0", &[(10, 43200), (13 * 3600, 24 * 3600)]),
            (
                "1/12:0/15",
                &[
                    (0, 3600),
                    (3600, 3600 + 15 * 60),
                    (3600 + 16 * 60, 3600 + 30 * 60),
                    (3600 + 30 * 60, 3600 + 45 * 60),
                    (3600 + 45 * 60, 3600 + 12 * 3600),
                    (13 * 3600 + 1, 13 * 3600 + 15 * 60),
                    (13 * 3600 + 15 * 60, 13 * 3600 + 30 * 60),
                    (13 * 3600 + 30 * 60, 13 * 3600 + 45 * 60),
                    (13 * 3600 + 45 * 60, 25 * 3600),
                ],
            ),
            ("1,4,6", &[(0, 60), (60, 240), (300, 360), (360, 3660)]),
            ("0..3", &[]),
            ("23..23:0..3", &[]),
            (
                "Mon",
                &[
                    (0, 4 * 86400),
                    (4 * 86400, 11 * 86400),
                    (11 * 86400, 18 * 86400),
                ],
            ),
            (
                "sat..sun",
                &[
                    (0, 2 * 86400),
                    (2 * 86400, 3 * 86400),
                    (3 * 86400, 9 * 86400),
                ],
            ),
            ("wed,mon..tue,fri", &[]),
            ("mon */15", &[]),
            (
                "22/1:0",
                &[
                    (0, 22 * 3600),
                    (22 * 3600, 23 * 3600),
                    (22 * 3600 + 59 * 60, 23 * 3600),
                ],
            ),
            ("*/2:*", &[(0, 60), (3600, 7200), (7200, 7260)]),
            (
                "20..22:*/30",
                &[
                    (0, 20 * 3600),
                    (20 * 3600, 20 * 3600 + 1800),
                    (22 * 3600 + 1800, 44 * 3600),
                ],
            ),
            ("0,1,3..5", &[(0, 60), (60, 180), (300, 3600)]),
            ("2,4:0,1,3..5", &[(0, 7200), (7260, 7380), (7500, 14400)]),
        ];
        for (text, next) in cases {
            let ev = CalendarEvent::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            for &(last, want) in *next {
                assert_eq!(
                    ev.next_after_in(last, Zone::Utc),
                    Some(want),
                    "{text} after {last}"
                );
            }
        }
        for (text, why) in [
            ("Fri..Mon", "wrong order in range 'Fri..Mon'"),
            ("61", "value '61' out of range"),
            ("*/61", "repetition '61' out of range"),
            ("0..80", "range end '80' out of range"),
            (" mon 0 0 0", "unused parts"),
            ("", "event is empty"),
            (" mon 0 0", "unused parts"),
        ] {
            assert_eq!(
                CalendarEvent::parse(text).map(|_| ()),
                Err(ParseError(why.to_string())),
                "{text:?}"
            );
        }
    }

    /// The examples of PVE's documentation of the format, and the schedules PVE's web interface
    /// offers for backup jobs.
    #[test]
    fn the_documented_examples() {
        // 2024-01-01 was a Monday.
        let monday = days_from_civil(2024, 1, 1) * 86_400;
        let next = |text: &str, last: i64| {
            CalendarEvent::parse(text)
                .unwrap_or_else(|e| panic!("{text}: {e}"))
                .next_after_in(last, Zone::Utc)
        };
        assert_eq!(next("mon..fri", monday), Some(monday + 86_400));
        assert_eq!(next("sat,sun", monday), Some(monday + 5 * 86_400));
        assert_eq!(next("12:05", monday), Some(monday + 12 * 3600 + 300));
        assert_eq!(next("mon..wed 30/10", monday), Some(monday + 1800));
        assert_eq!(
            next("mon..fri 8..17,22:0/15", monday + 17 * 3600 + 45 * 60),
            Some(monday + 22 * 3600)
        );
        assert_eq!(
            next("fri 12..13:5/20", monday),
            Some(monday + 4 * 86_400 + 12 * 3600 + 300)
        );
        assert_eq!(
            next("12,14,16,18,20,22:5", monday + 22 * 3600 + 300),
            Some(monday + 86_400 + 12 * 3600 + 300)
        );
        assert_eq!(
            next("12/2:5", monday + 13 * 3600),
            Some(monday + 14 * 3600 + 300)
        );
        assert_eq!(next("*-05", monday), Some(monday + 4 * 86_400));
        // The first Saturday of February 2024 was the 3rd.
        assert_eq!(
            next("Sat *-1..7 15:00", days_from_civil(2024, 1, 31) * 86_400),
            Some(days_from_civil(2024, 2, 3) * 86_400 + 15 * 3600)
        );
        assert_eq!(
            next("2015-10-21", 0),
            Some(days_from_civil(2015, 10, 21) * 86_400)
        );
        assert_eq!(next("2015-10-21", monday), None);
        assert_eq!(next("daily", monday), Some(monday + 86_400));
        assert_eq!(next("weekly", monday), Some(monday + 7 * 86_400));
        assert_eq!(
            next("monthly", monday),
            Some(days_from_civil(2024, 2, 1) * 86_400)
        );
        assert_eq!(
            next("quarterly", monday),
            Some(days_from_civil(2024, 4, 1) * 86_400)
        );
        assert_eq!(next("hourly", monday), Some(monday + 3600));
        assert_eq!(next("21:00", monday), Some(monday + 21 * 3600));
        assert_eq!(next("2,22:30", monday), Some(monday + 2 * 3600 + 1800));
        assert_eq!(next("sat 02:00", monday), Some(monday + 5 * 86_400 + 7200));
        assert_eq!(next("*/30", monday), Some(monday + 1800));
        assert_eq!(next("12:00:30", monday), Some(monday + 12 * 3600 + 30));
        assert_eq!(
            next("Sunday 01:00 UTC", monday),
            Some(monday + 6 * 86_400 + 3600)
        );
        assert!(CalendarEvent::parse("Sunday 01:00 UTC").is_ok_and(|e| e.utc));
    }

    #[test]
    fn local_time_follows_the_zone() {
        // The process's zone is whatever the machine's is; UTC events ignore it.
        let ev = CalendarEvent::parse("03:00 UTC").map_err(|e| e.to_string());
        assert_eq!(ev.map(|e| e.next_after(0)), Ok(Some(3 * 3600)));
        // Local events land on the local 03:00: the local date and hour of the answer.
        let local = CalendarEvent::parse("03:00")
            .ok()
            .and_then(|e| e.next_after(86_400 * 100));
        let t = local.unwrap_or_default();
        assert!(t > 86_400 * 100 && t <= 86_400 * 102, "{t}");
    }

    #[test]
    fn any_text_parses_or_refuses_without_panicking() {
        for text in [
            "*/0",
            "..",
            "mon..",
            "..fri",
            "1..",
            "-",
            "--",
            "*-*-*-*",
            ":::",
            "9999-12-31 23:59:59",
            "0/1",
            "*/1:*/1:*/1",
            "mon,",
            ",",
            "99999",
            "1..2..3",
            "UTC",
            " UTC",
            "xUTC",
            "mon UTC",
            "2024-02-30",
            "2024-02-29",
        ] {
            if let Ok(ev) = CalendarEvent::parse(text) {
                let _ = ev.next_after_in(0, Zone::Utc);
            }
        }
        // A date that never comes.
        assert_eq!(
            CalendarEvent::parse("*-02-30")
                .ok()
                .and_then(|e| e.next_after_in(0, Zone::Utc)),
            None
        );
    }

    /// pve-common's time zone cases: the end of summer time in Vienna (2018-10-28) neither
    /// stops the search nor shifts a local event; a `UTC` event lands on its UTC hour.
    #[test]
    fn a_dst_change_in_a_named_zone() {
        let Ok(vienna) = jiff::tz::TimeZone::get("Europe/Vienna") else {
            panic!("the time zone database (tzdata) has no Europe/Vienna");
        };
        let local = |y, m, d, h| {
            epoch(&vienna, (y, m, d), h, 0, 0).unwrap_or_else(|| panic!("{y}-{m}-{d} {h}h"))
        };
        let ev = CalendarEvent::parse("mon..fri").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            ev.next_in(local(2018, 10, 28, 0), &vienna),
            Some(local(2018, 10, 29, 0))
        );
        let ev = CalendarEvent::parse("mon..fri UTC").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            ev.next_in(local(2018, 10, 28, 0), &jiff::tz::TimeZone::UTC),
            Some(local(2018, 10, 29, 1))
        );
        // 02:30 does not exist on 2019-03-31 in Vienna: the event moves to 03:30 that day.
        let ev = CalendarEvent::parse("02:30").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            ev.next_in(local(2019, 3, 31, 0), &vienna),
            Some(local(2019, 3, 31, 3) + 1800)
        );
    }

    #[test]
    fn civil_days_round_trip() {
        for z in [-800_000i64, -1, 0, 1, 59, 60, 10_956, 19_723, 2_932_896] {
            let (y, m, d) = civil_from_days(z);
            assert_eq!(days_from_civil(y, m, d), z);
        }
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
    }
}
