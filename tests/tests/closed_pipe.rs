//! A closed pipe stops the output, never the work: `felhom-agent guests | true`,
//! `journal | head -1`, `vmid-check 160 --json | grep -q …` end with the command's own exit
//! status, never a panic (exit 101, "failed printing to stdout"); a provision whose stdout and
//! stderr go to a reader that leaves after the first line runs to its end and settles its
//! transaction. And a writing command that takes up a transaction a stopped run left open
//! says so on stdout, with how it ended.

use std::io::{BufRead, BufReader, Read};
use std::process::Stdio;

use felhom_tests::world::World;
use serde_json::{json, Value};

/// Run the agent with `args`, the reader of `closed` (stdout or stderr) gone before the agent
/// writes to it: the other stream is returned.
fn run_closed(w: &World, args: &[&str], closed: &str) -> (Option<i32>, String) {
    let mut child = w
        .command()
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the agent");
    let (mut keep, gone): (Box<dyn Read>, Box<dyn Read>) = match closed {
        "stdout" => (
            Box::new(child.stderr.take().expect("stderr")),
            Box::new(child.stdout.take().expect("stdout")),
        ),
        _ => (
            Box::new(child.stdout.take().expect("stdout")),
            Box::new(child.stderr.take().expect("stderr")),
        ),
    };
    drop(gone);
    let mut other = String::new();
    keep.read_to_string(&mut other)
        .expect("read the other stream");
    let status = child.wait().expect("wait for the agent");
    (status.code(), other)
}

fn assert_no_crash(args: &[&str], closed: &str, code: Option<i32>, want: i32, other: &str) {
    assert_eq!(
        code,
        Some(want),
        "{args:?} with {closed} closed: exit {code:?}, the other stream:\n{other}"
    );
    for crash in [
        "panicked",
        "failed printing",
        "Broken pipe",
        "RUST_BACKTRACE",
    ] {
        assert!(
            !other.contains(crash),
            "{args:?} with {closed} closed: {crash:?} on the other stream:\n{other}"
        );
    }
}

#[test]
fn read_commands_whose_reader_left_end_with_their_own_status() {
    let w = World::demo();
    for (args, want) in [
        (&["guests"][..], 0),
        (&["guests", "--json"], 0),
        (&["journal"], 0),
        (&["journal", "--json"], 0),
        (&["vmid-check", "160", "--json"], 0),
        (&["vmid-check", "200"], 3),
        (&["doctor"], 0),
    ] {
        let (code, stderr) = run_closed(&w, args, "stdout");
        // doctor fails on this bed's node (e.g. not root); its status is its own, not 101.
        let want = if args == ["doctor"] {
            w.agent(args).code.unwrap_or(-1)
        } else {
            want
        };
        assert_no_crash(args, "stdout", code, want, &stderr);
    }
    // Errors go to stderr: with stderr gone the error is lost, the status is not.
    let (code, stdout) = run_closed(&w, &["vmid-check", "160", "--config-typo"], "stderr");
    assert_no_crash(
        &["vmid-check", "160", "--config-typo"],
        "stderr",
        code,
        2,
        &stdout,
    );
    let missing = w.files.config_path.with_file_name("missing.toml");
    let (code, stdout) = {
        let mut child = felhom_tests::agent::agent_command(&missing)
            .arg("guests")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the agent");
        drop(child.stderr.take());
        let mut out = String::new();
        child
            .stdout
            .take()
            .expect("stdout")
            .read_to_string(&mut out)
            .expect("read stdout");
        (child.wait().expect("wait").code(), out)
    };
    assert_no_crash(&["guests"], "stderr (config missing)", code, 6, &stdout);
}

#[test]
fn a_provision_whose_reader_leaves_after_the_first_line_runs_to_its_end() {
    let w = World::demo();
    let (reader, writer) = std::io::pipe().expect("pipe");
    let mut cmd = w.command();
    cmd.args(["--selftest=provision", "-vmid", "182"])
        .stdin(Stdio::null())
        .stdout(Stdio::from(writer.try_clone().expect("clone the pipe")))
        .stderr(Stdio::from(writer));
    let mut child = cmd.spawn().expect("start the agent");
    // The parent's copies of the write end go with the command.
    drop(cmd);
    let mut first = String::new();
    BufReader::new(reader)
        .read_line(&mut first)
        .expect("read the first line");
    assert!(!first.is_empty(), "the agent wrote nothing");
    // The reader is gone (`| head -1`): every later write of the agent fails with EPIPE.
    let status = child.wait().expect("wait for the agent");
    assert_eq!(
        status.code(),
        Some(0),
        "the provision did not run to its end with its reader gone (first line: {first})"
    );
    let t: Vec<Value> = w
        .journal()
        .into_iter()
        .filter(|t| t["vmid"] == 182)
        .collect();
    assert_eq!(t.len(), 1, "{t:#?}");
    assert_eq!(t[0]["outcome"], "ok", "{:#}", t[0]);
    assert_eq!(t[0]["destroyed"], json!(true), "{:#}", t[0]);
    assert_eq!(w.pve.deletes_for(182).len(), 1);
}

#[test]
fn a_command_that_takes_up_another_vmids_open_transaction_says_so() {
    let w = World::demo();
    // A provision of 182 killed after its fifth journal record (created, armed): open.
    let killed = w
        .command()
        .args(["--selftest=provision", "-vmid", "182", "--json"])
        .env("FELHOM_AGENT_KILL_AT", "after-journal:5")
        .output()
        .expect("run the agent");
    assert_eq!(killed.status.code(), None, "not killed");
    let open = w
        .journal()
        .into_iter()
        .find(|t| t["vmid"] == 182)
        .expect("the open transaction");
    assert!(open["outcome"].is_null(), "{open:#}");
    let txn = open["txn"].as_str().expect("txn").to_string();

    // An unrelated destroy: nothing holds 555, but the open provision is taken up first.
    let run = w.agent(&["destroy", "-vmid", "555"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let line = run
        .stdout
        .lines()
        .find(|l| l.contains(&txn))
        .unwrap_or_else(|| {
            panic!(
                "stdout does not name the transaction {txn} it took up:\n{}\nstderr:\n{}",
                run.stdout, run.stderr
            )
        });
    for part in [
        "took up",
        "selftest-provision",
        "vmid 182",
        "ok in phase",
        "destroyed: true",
    ] {
        assert!(line.contains(part), "no {part:?} in {line:?}");
    }
    assert!(
        run.stdout.contains("vmid 555: nothing to destroy"),
        "{}",
        run.stdout
    );
    assert_eq!(w.journal_txn(&txn)["outcome"], "ok");
    assert_eq!(w.pve.deletes_for(182).len(), 1);

    // The same in the document of --json, and nothing when nothing was open.
    let run = w.agent(&["destroy", "-vmid", "555", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert!(run.json().get("taken_up").is_none(), "{}", run.stdout);
    let killed = w
        .command()
        .args(["--selftest=provision", "-vmid", "183"])
        .env("FELHOM_AGENT_KILL_AT", "after-journal:5")
        .output()
        .expect("run the agent");
    assert_eq!(killed.status.code(), None, "not killed");
    let run = w.agent(&["destroy", "-vmid", "555", "--json"]);
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let doc = run.json();
    let taken = doc["taken_up"].as_array().expect("taken_up");
    assert_eq!(taken.len(), 1, "{doc:#}");
    assert_eq!(taken[0]["vmid"], 183, "{doc:#}");
    assert_eq!(taken[0]["outcome"], "ok", "{doc:#}");
    assert_eq!(taken[0]["found_at_phase"], "created", "{doc:#}");
}
