//! Durable-log tests against a real temporary directory: the record format, torn tails,
//! corruption, caps, rewrite.

use super::*;

const LIMITS: Limits = Limits {
    max_record_bytes: 512,
    max_file_bytes: 4096,
};

fn create(dir: &Path, name: &str) -> LogFile {
    LogFile::open(&dir.join(name), LIMITS, OpenMode::Create)
        .expect("open")
        .expect("created")
}

fn append_payloads(log: &mut LogFile, payloads: &[&str]) -> u64 {
    let mut lines = String::new();
    for p in payloads {
        lines.push_str(&LIMITS.encode(p).expect("encode"));
    }
    log.append(lines.as_bytes()).expect("append")
}

/// A temporary folder with `a.log` holding these payloads.
fn file_with(payloads: &[&str]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tmp");
    append_payloads(&mut create(dir.path(), "a.log"), payloads);
    let path = dir.path().join("a.log");
    (dir, path)
}

fn payloads(log: &mut LogFile) -> (Vec<String>, Option<Torn>) {
    let contents = log.read(|p| Ok(p.to_string())).expect("read");
    let values = contents.entries.into_iter().map(|e| e.value).collect();
    (values, contents.torn)
}

fn reopen(path: &Path) -> LogFile {
    LogFile::open(path, LIMITS, OpenMode::Write)
        .expect("open")
        .expect("exists")
}

#[test]
fn each_record_is_one_versioned_checksummed_line() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut log = create(dir.path(), "a.log");
    append_payloads(&mut log, &["{\"n\":1}", "{\"n\":2,\"s\":\"x y\"}"]);
    let text = fs::read_to_string(dir.path().join("a.log")).expect("read");
    assert!(text.ends_with('\n'));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2);
    for (line, payload) in lines.iter().zip(["{\"n\":1}", "{\"n\":2,\"s\":\"x y\"}"]) {
        // One JSON object: the version, the checksum, the payload as written.
        let v: serde_json::Value = serde_json::from_str(line).expect("json line");
        assert_eq!(v["v"], FORMAT_VERSION);
        assert_eq!(
            v["rec"],
            serde_json::from_str::<serde_json::Value>(payload).expect("payload")
        );
        // The checksum is the SHA-256 of the payload bytes exactly as written.
        let rec = line
            .split_once(",\"rec\":")
            .and_then(|(_, r)| r.strip_suffix('}'))
            .expect("rec part");
        assert_eq!(rec, payload);
        let sum = hex::encode(Sha256::digest(rec.as_bytes()));
        assert_eq!(v["sum"].as_str(), Some(sum.as_str()));
        assert_eq!(line_sum(line), sum);
        assert_eq!(decode_line(line.as_bytes()), Ok((payload, sum.as_str())));
    }
}

#[test]
fn a_record_torn_mid_line_is_left_out_then_cut_off_and_the_rest_is_kept() {
    let (_dir, path) = file_with(&["{\"n\":1}", "{\"n\":2}"]);
    let full = fs::metadata(&path).expect("stat").len();
    for cut in [full - 1, full - 10, full - 40] {
        let copy = tempfile::tempdir().expect("tmp");
        let copy_path = copy.path().join("a.log");
        fs::copy(&path, &copy_path).expect("copy");
        OpenOptions::new()
            .write(true)
            .open(&copy_path)
            .expect("open")
            .set_len(cut)
            .expect("truncate");
        let mut log = reopen(&copy_path);
        let (values, torn) = payloads(&mut log);
        assert_eq!(values, vec!["{\"n\":1}"], "cut at {cut}");
        assert_eq!(torn.map(|t| t.line), Some(2), "cut at {cut}");
        // Reading writes nothing.
        assert_eq!(fs::metadata(&copy_path).expect("stat").len(), cut);
        // The next append goes right after the last whole record.
        append_payloads(&mut log, &["{\"n\":3}"]);
        drop(log);
        let (values, torn) = payloads(&mut reopen(&copy_path));
        assert_eq!(torn, None);
        assert_eq!(values, vec!["{\"n\":1}", "{\"n\":3}"]);
    }

    // cut_tail cuts it off without an append.
    let mut whole = fs::read(&path).expect("read");
    whole.extend_from_slice(b"{\"v\":1,\"su");
    fs::write(&path, &whole).expect("write");
    let mut log = reopen(&path);
    assert!(payloads(&mut log).1.is_some());
    assert!(log.cut_tail().expect("cut"));
    assert_eq!(fs::metadata(&path).expect("stat").len(), full);
    assert!(!log.cut_tail().expect("cut again"));
}

#[test]
fn a_flipped_byte_in_the_last_record_is_a_torn_tail_but_earlier_is_corruption() {
    let (_dir, path) = file_with(&["{\"n\":111}", "{\"n\":222}"]);
    let original = fs::read(&path).expect("read");
    let mut last = original.clone();
    let at = last.len() - 5;
    last[at] = b'9';
    fs::write(&path, &last).expect("write");
    let (values, torn) = payloads(&mut reopen(&path));
    assert_eq!(values, vec!["{\"n\":111}"]);
    let torn = torn.expect("torn");
    assert_eq!(torn.line, 2);
    assert!(torn.reason.contains("checksum"), "{}", torn.reason);

    let mut first = original;
    let at = first.iter().position(|b| *b == b'\n').expect("newline") - 5;
    first[at] = b'9';
    fs::write(&path, &first).expect("write");
    let err = reopen(&path).read(|p| Ok(p.len())).unwrap_err();
    assert!(matches!(err, LogError::Corrupt { line: 1, .. }), "{err}");
    assert!(err.to_string().contains("a.log"), "{err}");
}

#[test]
fn the_decoder_decides_between_a_torn_payload_and_a_corrupt_one() {
    let (_dir, path) = file_with(&["1", "2", "bad"]);
    let decode = |p: &str| match p.parse::<u32>() {
        Ok(9) => Err(Reject::Corrupt("nine is not allowed here".to_string())),
        Ok(n) => Ok(n),
        Err(e) => Err(Reject::Damaged(e.to_string())),
    };
    // An undecodable last payload is a torn tail.
    let contents = reopen(&path).read(decode).expect("read");
    assert_eq!(
        contents.entries.iter().map(|e| e.value).collect::<Vec<_>>(),
        vec![1, 2]
    );
    assert_eq!(contents.torn.map(|t| t.line), Some(3));
    // The next append cuts it off.
    let mut log = reopen(&path);
    log.read(decode).expect("read");
    append_payloads(&mut log, &["3"]);
    let text = fs::read_to_string(&path).expect("read");
    assert_eq!(text.lines().count(), 3, "the torn line was cut off: {text}");
    // Before the last line it is corruption.
    fs::write(
        &path,
        format!("{}{}", LIMITS.encode("bad").expect("e"), text),
    )
    .expect("write");
    assert!(matches!(
        reopen(&path).read(decode),
        Err(LogError::Corrupt { line: 1, .. })
    ));
    // A payload the owner rejects is corruption even on the last line.
    fs::write(&path, format!("{text}{}", LIMITS.encode("9").expect("e"))).expect("write");
    match reopen(&path).read(decode) {
        Err(LogError::Corrupt { line, reason, .. }) => {
            assert_eq!(line, 4);
            assert!(reason.contains("nine"), "{reason}");
        }
        other => panic!("expected corruption, got {other:?}"),
    }
}

#[test]
fn a_newer_format_version_is_refused() {
    let (_dir, path) = file_with(&["1", "2"]);
    let text = fs::read_to_string(&path).expect("read");
    fs::write(&path, text.replacen("{\"v\":1,", "{\"v\":2,", 1)).expect("write");
    match reopen(&path).read(|p| Ok(p.len())) {
        Err(LogError::UnsupportedVersion { version, line, .. }) => {
            assert_eq!((version, line), (2, 1));
        }
        other => panic!("expected a version error, got {other:?}"),
    }
    assert_eq!(
        decode_line(b"{\"v\":7,\"sum\":\"\"}"),
        Err(LineError::Version(7))
    );
}

#[test]
fn size_caps_refuse_and_write_nothing() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("a.log");
    let mut log = create(dir.path(), "a.log");

    // One record over the per-record cap, or not one line.
    let huge = format!("\"{}\"", "y".repeat(600));
    assert!(matches!(
        LIMITS.encode(&huge),
        Err(EncodeError::TooLarge { max: 512, size }) if size > 600
    ));
    assert_eq!(LIMITS.encode("{\n}"), Err(EncodeError::NotOneLine));
    assert_eq!(LIMITS.encode(""), Err(EncodeError::NotOneLine));

    // Appends until the file cap: refused, nothing written, the file stays readable.
    let body = format!("\"{}\"", "x".repeat(300));
    let mut n = 0;
    let err = loop {
        n += 1;
        assert!(n < 100, "the cap never refused");
        let line = LIMITS.encode(&body).expect("encode");
        if !log.fits(line.len() as u64) {
            break log.append(line.as_bytes()).unwrap_err();
        }
        log.append(line.as_bytes()).expect("append");
    };
    assert!(matches!(err, LogError::Full { max: 4096, .. }), "{err}");
    let size = fs::metadata(&path).expect("stat").len();
    assert_eq!(size, log.len());
    assert!(size <= 4096);
    let (values, torn) = payloads(&mut reopen(&path));
    assert_eq!((values.len(), torn), (n - 1, None));

    // A file over the cap on disk is not read.
    fs::write(&path, vec![b'x'; 5000]).expect("write");
    assert!(matches!(
        reopen(&path).read(|p| Ok(p.len())),
        Err(LogError::TooLarge {
            size: 5000,
            max: 4096,
            ..
        })
    ));
}

#[test]
fn rewrite_keeps_the_chosen_records_and_truncate_empties() {
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("a.log");
    let mut log = create(dir.path(), "a.log");
    append_payloads(&mut log, &["1", "22", "333", "4444"]);
    let entries = log.read(|p| Ok(p.to_string())).expect("read").entries;
    let keep: Vec<(u64, u32)> = entries
        .iter()
        .filter(|e| e.value.len() % 2 == 1)
        .map(|e| (e.offset, e.len))
        .collect();
    let offsets = log.rewrite(&keep).expect("rewrite");
    assert_eq!(offsets[0], 0);
    assert_eq!(offsets[1], u64::from(keep[0].1));
    assert_eq!(log.read_at(offsets[1], keep[1].1).expect("read"), "333");
    assert!(!dir.path().join("a.log.tmp").exists());
    let (values, _) = payloads(&mut reopen(&path));
    assert_eq!(values, vec!["1", "333"]);
    // Appends go after the kept records.
    append_payloads(&mut log, &["5"]);
    assert_eq!(payloads(&mut reopen(&path)).0, vec!["1", "333", "5"]);
    // A record read back by position is checked again.
    let mut bytes = fs::read(&path).expect("read");
    bytes[offsets[1] as usize + 20] ^= 0x01;
    fs::write(&path, &bytes).expect("write");
    assert!(matches!(
        log.read_at(offsets[1], keep[1].1),
        Err(LogError::Corrupt { .. })
    ));

    log.truncate().expect("truncate");
    assert_eq!((log.len(), log.is_empty()), (0, true));
    assert_eq!(fs::metadata(&path).expect("stat").len(), 0);
}

#[test]
fn open_modes_say_whether_the_file_exists_and_new_files_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("a.log");
    for mode in [OpenMode::Read, OpenMode::Write] {
        assert!(LogFile::open(&path, LIMITS, mode).expect("open").is_none());
    }
    let mut log = LogFile::open(&path, LIMITS, OpenMode::CreateNew)
        .expect("open")
        .expect("new");
    append_payloads(&mut log, &["1"]);
    assert!(LogFile::open(&path, LIMITS, OpenMode::CreateNew)
        .expect("open")
        .is_none());
    let mode = fs::metadata(&path).expect("stat").permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let mut read_only = LogFile::open(&path, LIMITS, OpenMode::Read)
        .expect("open")
        .expect("exists");
    assert_eq!(payloads(&mut read_only).0, vec!["1"]);
}
