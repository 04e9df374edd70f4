//! What the root helper hands over of `/etc/pve/datacenter.cfg` (tests/data/pve-secrets-facts.md).
//!
//! The file is one `key: value` line per setting (pve-cluster `src/PVE/DataCenterConfig.pm`
//! `parse_datacenter_config`, through pve-common `src/PVE/JSONSchema.pm` `parse_config`); lines
//! starting with `#` are the cluster's description. Some settings hold secrets: `http_proxy`
//! is a URL that may carry a user and password (`http://user:password@host:port/`).
//!
//! The agent reads three keys of it: the tag policy (`user-tag-access`, `registered-tags`:
//! [`crate::preflight::restorable::TagPolicy::parse`]) and the `next-id` range
//! ([`crate::vmid::next_id_lint`]). [`needed_lines`] keeps the lines of those keys and nothing
//! else; both readers read the answer as they read the whole file (the property tests below
//! hold them equal).

/// The keys of `datacenter.cfg` the agent reads.
pub const NEEDED_KEYS: [&str; 3] = ["user-tag-access", "registered-tags", "next-id"];

/// A line's key as the agent's readers take it: the text before its first `:`, blanks
/// trimmed. PVE takes the key before the same first `:` (`^(\S+?):`, on the trimmed line), so
/// a line PVE reads as another key (`http_proxy`, …) never has a needed key here.
fn key_of(line: &str) -> Option<&str> {
    line.split_once(':').map(|(key, _)| key.trim())
}

/// What the root helper hands over of `text` (the whole `datacenter.cfg`): the lines whose key
/// is one of [`NEEDED_KEYS`], byte for byte with their own line ends and in their order (a
/// repeated key too: the last one counts, for PVE and the agent alike); no comment, no other
/// key. Lines end at `\n` only, as PVE and the agent's readers end them.
pub fn needed_lines(text: &str) -> String {
    text.split_inclusive('\n')
        .filter(|line| key_of(line).is_some_and(|k| NEEDED_KEYS.contains(&k)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preflight::restorable::TagPolicy;
    use crate::vmid::next_id_lint;
    use std::path::Path;

    /// A `datacenter.cfg` as PVE writes it, with a proxy password and a description.
    const WITH_SECRETS: &str = "#Cluster%20of%20SECRET-DESCRIPTION\n\
        #second line\n\
        keyboard: en-us\n\
        http_proxy: http://proxyuser:SECRET-PROXY-PASSWORD@proxy.example.invalid:3128/\n\
        email_from: pve@example.invalid\n\
        next-id: lower=10000,upper=990000\n\
        notify: package-updates=always\n\
        registered-tags: prod;felhom-core\n\
        tag-style: color-map=prod:ff0000,ordering=config\n\
        user-tag-access: user-allow=list,user-allow-list=felhom;web\n\
        webauthn: rp=pve.example.invalid,origin=https://pve.example.invalid:8006,id=pve.example.invalid\n";

    fn same_reading(whole: &str, crossed: &str) -> bool {
        let p = Path::new("/etc/pve/datacenter.cfg");
        TagPolicy::parse(whole) == TagPolicy::parse(crossed)
            && next_id_lint(p, whole) == next_id_lint(p, crossed)
    }

    #[test]
    fn only_the_tag_policy_and_next_id_lines_cross() {
        let out = needed_lines(WITH_SECRETS);
        assert_eq!(
            out,
            "next-id: lower=10000,upper=990000\n\
             registered-tags: prod;felhom-core\n\
             user-tag-access: user-allow=list,user-allow-list=felhom;web\n"
        );
        for secret in ["SECRET", "http_proxy", "proxyuser", "example.invalid", "#"] {
            assert!(!out.contains(secret), "{secret} crossed: {out}");
        }
        assert!(same_reading(WITH_SECRETS, &out));
        let policy = TagPolicy::parse(&out);
        assert_eq!(policy.user_allow, "list");
        assert_eq!(policy.registered, ["prod", "felhom-core"]);
        // A proxy line shaped to look like a needed key is still the proxy's.
        let text = "http_proxy: http://next-id:SECRET@h/\nhttp_proxy:next-id: SECRET\n\
                    # next-id: lower=1\n next-id : lower=5,upper=6\r\n";
        assert_eq!(needed_lines(text), " next-id : lower=5,upper=6\r\n");
        assert_eq!(needed_lines(""), "");
    }

    proptest::proptest! {
        #[test]
        fn any_text_never_panics_and_the_needed_lines_read_as_the_whole(text in "[\\PC\t\n\r\u{0}\u{b}\u{c}]*") {
            let crossed = needed_lines(&text);
            proptest::prop_assert!(same_reading(&text, &crossed), "{:?} -> {:?}", text, crossed);
            proptest::prop_assert_eq!(needed_lines(&crossed), crossed);
        }

        #[test]
        fn datacenter_cfg_shaped_text_reads_the_same_and_only_needed_keys_cross(
            lines in proptest::collection::vec(
                (
                    "[ \t#]{0,2}(user-tag-access|registered-tags|next-id|http_proxy|tag-style|keyboard|)[ \t]{0,2}",
                    "(:[ \t]?)?",
                    "(user-allow|user-allow-list|lower|upper|http|x)?[=:]?[a-z0-9;,=:@/ \t-]{0,12}",
                    "\r?",
                ),
                0..14,
            )
        ) {
            let text: String = lines
                .iter()
                .map(|(key, colon, value, cr)| format!("{key}{colon}{value}{cr}\n"))
                .collect();
            let crossed = needed_lines(&text);
            proptest::prop_assert!(same_reading(&text, &crossed), "{:?} -> {:?}", text, crossed);
            for line in crossed.lines() {
                // PVE's key of the line (`^(\S+?):` on the trimmed line), if it reads one.
                let pve_key = line.trim().split_once(':').map(|(k, _)| k);
                proptest::prop_assert!(
                    pve_key.is_some_and(|k| ["user-tag-access", "registered-tags", "next-id"].contains(&k.trim())),
                    "{:?} crossed: {:?}", line, crossed
                );
            }
        }
    }
}
