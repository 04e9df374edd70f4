//! UTC timestamps in RFC 3339, the one format used in the journal, reports and logs.

use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

/// Now, in UTC, as RFC 3339 (`2026-11-29T22:46:46.123Z`).
pub fn now_rfc3339() -> String {
    rfc3339(OffsetDateTime::now_utc())
}

/// A UTC instant as RFC 3339.
pub fn rfc3339(t: OffsetDateTime) -> String {
    t.to_offset(time::UtcOffset::UTC)
        .format(&Rfc3339)
        .unwrap_or_else(|_| t.unix_timestamp().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_utc_with_z() {
        let t = OffsetDateTime::from_unix_timestamp(1_767_225_600)
            .unwrap_or(OffsetDateTime::UNIX_EPOCH);
        assert_eq!(rfc3339(t), "2026-01-01T00:00:00Z");
    }
}
