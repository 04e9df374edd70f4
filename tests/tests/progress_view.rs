//! The live view on a terminal (stdout and stderr on one pseudo-terminal, as an operator sees
//! them): the preflight's report comes before the phases it ran before, once; a phase that
//! failed ends with `x`, never with the `+` of a finished one.

use std::process::Command;

use felhom_tests::world::World;

/// Run the agent with `args` on a pseudo-terminal (stdout and stderr both): its exit status
/// and everything the terminal showed.
fn on_terminal(w: &World, args: &[&str]) -> (Option<i32>, String) {
    let agent = w.command();
    let mut cmd = Command::new("python3");
    cmd.arg("-c")
        .arg(
            "import os,pty,sys\n\
             pid,fd=pty.fork()\n\
             if pid==0:\n    os.execv(sys.argv[1],sys.argv[1:])\n\
             out=b''\n\
             while True:\n    try:\n        d=os.read(fd,65536)\n    except OSError:\n        break\n    if not d:\n        break\n    out+=d\n\
             _,st=os.waitpid(pid,0)\n\
             sys.stdout.buffer.write(out)\n\
             sys.exit(os.waitstatus_to_exitcode(st))\n",
        )
        .arg(agent.get_program())
        .args(agent.get_args())
        .args(args);
    for (k, v) in agent.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let out = cmd.output().expect("python3 with a pty");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout)
            .replace("\x1b[2K", "")
            .replace('\r', "\n"),
    )
}

#[test]
fn the_preflight_shows_before_the_phases_once() {
    let w = World::demo();
    let (code, seen) = on_terminal(&w, &["--selftest=provision", "-vmid", "140"]);
    assert_eq!(code, Some(0), "{seen}");
    let preflight = seen
        .find("preflight (read only):")
        .unwrap_or_else(|| panic!("no preflight: {seen}"));
    let first_phase = seen
        .find("vmid 140: network")
        .unwrap_or_else(|| panic!("no live view: {seen}"));
    assert!(
        preflight < first_phase,
        "the live view came before the preflight that ran first: {seen}"
    );
    assert_eq!(seen.matches("preflight (read only):").count(), 1, "{seen}");
}

#[test]
fn a_failed_phase_is_marked_x() {
    let w = World::demo();
    // 101 is a foreign guest's: refused in the first phase.
    let (code, seen) = on_terminal(&w, &["--selftest=provision", "-vmid", "101"]);
    assert_eq!(code, Some(3), "{seen}");
    // The spinner's frames aside, the phase's closing line: `x`, never `+`.
    let closed: Vec<&str> = seen
        .lines()
        .map(str::trim_start)
        .filter(|l| l.get(2..).is_some_and(|r| r.starts_with("failed")))
        .filter(|l| l.starts_with(['+', 'x', '!']))
        .collect();
    assert!(
        !closed.is_empty(),
        "no closed line of the failed phase: {seen}"
    );
    for l in closed {
        assert!(
            l.starts_with("x "),
            "a failed phase marked like a finished one: {l:?}\n{seen}"
        );
    }
}
