//! Framed output: one exec in the guest runs several commands, each with its own output caught
//! in a file, and prints them back one after the other as frames, so the agent reads each
//! command's stdout and stderr apart from one stream (one trip into the guest instead of one per
//! command: on a node each trip is a new `pct` process, or a guest-agent `exec` and its polls).
//!
//! A frame is a header line `felhom-frame <name> <length> <size>` followed by exactly `<length>`
//! bytes and a newline: `<length>` bytes of the file were kept (at most the cap asked for),
//! `<size>` is how long the file was. The shell function [`FRAME_FN`] prints one. Everything
//! else in the stream is a plain line. What the guest prints is hostile: the reader never trusts
//! a length beyond the bytes it has, never panics, and keeps at most [`MAX_ITEMS`] items.

/// The shell function `felhom_frame NAME FILE CAP`: prints FILE's first CAP bytes as a frame
/// named NAME (a missing or empty file is an empty frame, printed without starting a process).
/// It keeps a copy of what it prints (`FILE.kept`), so the length it announces is the length of
/// what follows, whatever a process still writing to FILE does meanwhile; FILE itself is
/// measured only when the copy reached CAP (shorter, the copy is the whole file). Each process
/// counts: in a VM under emulation or a loaded guest one costs tens of milliseconds. `head -c`
/// and `wc -c` are in coreutils and busybox.
pub const FRAME_FN: &str = r#"
felhom_frame() {
  if [ ! -s "$2" ]; then echo "felhom-frame $1 0 0"; echo; return 0; fi
  head -c "$3" "$2" >"$2.kept" 2>/dev/null
  felhom_n=$(wc -c <"$2.kept"); felhom_all=$felhom_n
  [ "$((felhom_n))" -lt "$3" ] || felhom_all=$(wc -c <"$2")
  echo "felhom-frame $1 $((felhom_n)) $((felhom_all))"
  cat "$2.kept"; echo
}
"#;

/// The shell functions of the scripts that run commands in the guest for the agent:
/// `felhom_ms` prints a time in milliseconds for durations: the guest's uptime from
/// `/proc/uptime` (read by the shell itself, to the hundredth of a second), else milliseconds
/// since the epoch from `date` (seconds where `date` has no `%N`);
/// `felhom_watched SECS OUT ERR KILLED CMD…` runs CMD (stdin `/dev/null`, stdout in OUT, stderr
/// in ERR; in a session of its own where the guest has `setsid`, so that what it starts goes
/// with it) beside a watchdog that, after SECS seconds, creates KILLED and kills CMD's process
/// group; `felhom_rc` is then CMD's exit status (137 and KILLED: the watchdog's kill).
pub const RUN_FNS: &str = r#"
felhom_ms() {
  if read -r felhom_t _ </proc/uptime 2>/dev/null; then
    case $felhom_t in
      *[!0-9.]* | .* | *. | *.*.* | '') ;;
      *.[0-9][0-9]) echo "$(( ${felhom_t%.*} * 1000 + 1${felhom_t#*.} * 10 - 1000 ))"; return 0 ;;
    esac
  fi
  felhom_t=$(date +%s%N 2>/dev/null)
  case $felhom_t in *[!0-9]*|'') echo "$(date +%s)000";; *) echo "$((felhom_t / 1000000))";; esac
}
felhom_watched() {
  felhom_s=$1 felhom_o=$2 felhom_e=$3 felhom_k=$4; shift 4
  if command -v setsid >/dev/null 2>&1; then setsid "$@" </dev/null >"$felhom_o" 2>"$felhom_e" &
  else "$@" </dev/null >"$felhom_o" 2>"$felhom_e" &
  fi
  felhom_p=$!
  ( n=0
    while kill -0 "$felhom_p" 2>/dev/null; do
      if [ "$n" -ge "$felhom_s" ]; then
        : >"$felhom_k"; kill -9 -"$felhom_p" 2>/dev/null; kill -9 "$felhom_p" 2>/dev/null; exit 0
      fi
      sleep 1; n=$((n+1))
    done ) >/dev/null 2>&1 </dev/null &
  felhom_w=$!
  wait "$felhom_p"; felhom_rc=$?
  kill "$felhom_w" 2>/dev/null
}
"#;

/// The most items (lines and frames) read from one stream.
pub const MAX_ITEMS: usize = 4096;

/// One item of a framed stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item<'a> {
    /// A plain line (without its newline).
    Line(&'a str),
    /// A frame: its name, the bytes kept, and whether the file was longer than what was kept
    /// (or the stream ended inside the frame).
    Frame {
        /// The name the script gave it.
        name: &'a str,
        /// The bytes kept.
        bytes: &'a [u8],
        /// The file was longer than the bytes kept.
        truncated: bool,
    },
}

/// Read a framed stream into its items, in order. Invalid UTF-8 in a plain line makes the line
/// empty (only the script's own words are read from lines).
pub fn parse(stream: &[u8]) -> Vec<Item<'_>> {
    let mut items = Vec::new();
    let mut rest = stream;
    while !rest.is_empty() && items.len() < MAX_ITEMS {
        let (line, after) = match rest.iter().position(|b| *b == b'\n') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, &rest[rest.len()..]),
        };
        rest = after;
        let text = std::str::from_utf8(line).unwrap_or("");
        let mut words = text.split(' ');
        if let (Some("felhom-frame"), Some(name), Some(len), Some(size), None) = (
            words.next(),
            words.next(),
            words.next(),
            words.next(),
            words.next(),
        ) {
            if let (Ok(len), Ok(size)) = (len.parse::<usize>(), size.parse::<u64>()) {
                let kept = len.min(rest.len());
                let bytes = &rest[..kept];
                rest = &rest[kept..];
                // The newline after the bytes.
                if rest.first() == Some(&b'\n') {
                    rest = &rest[1..];
                }
                items.push(Item::Frame {
                    name,
                    bytes,
                    truncated: kept < len || size > len as u64,
                });
                continue;
            }
        }
        items.push(Item::Line(text));
    }
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_and_lines_are_read_apart_whatever_the_bytes_hold() {
        let stream = b"hello\nfelhom-frame 1o 5 5\na\nb\0c\nfelhom-frame 1e 0 0\n\nbye\n";
        let items = parse(stream);
        assert_eq!(
            items,
            vec![
                Item::Line("hello"),
                Item::Frame {
                    name: "1o",
                    bytes: b"a\nb\0c",
                    truncated: false
                },
                Item::Frame {
                    name: "1e",
                    bytes: b"",
                    truncated: false
                },
                Item::Line("bye"),
            ]
        );
    }

    #[test]
    fn a_length_beyond_the_stream_or_a_longer_file_is_truncated_not_a_panic() {
        let items = parse(b"felhom-frame x 100 100\nabc");
        assert_eq!(
            items,
            vec![Item::Frame {
                name: "x",
                bytes: b"abc",
                truncated: true
            }]
        );
        let items = parse(b"felhom-frame x 2 9\nab\n");
        assert_eq!(
            items,
            vec![Item::Frame {
                name: "x",
                bytes: b"ab",
                truncated: true
            }]
        );
        // A header that is not one is a plain line.
        let items = parse(b"felhom-frame x -1 0\nfelhom-frame x 1\n");
        assert_eq!(
            items,
            vec![
                Item::Line("felhom-frame x -1 0"),
                Item::Line("felhom-frame x 1")
            ]
        );
    }

    #[test]
    fn a_flood_of_lines_is_bounded() {
        let stream = "x\n".repeat(MAX_ITEMS * 2);
        assert_eq!(parse(stream.as_bytes()).len(), MAX_ITEMS);
    }
}
