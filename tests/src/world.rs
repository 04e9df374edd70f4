//! A whole provisioning world for end-to-end tests and benchmarks: a fake PVE, the guest bed
//! (guests as real root filesystems, made by the fake as it restores them: containers behind
//! the `pct` stand-in, VMs behind the fake's guest agent), and the agent's files with the
//! package's default bootstrap profile and check pack.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::agent::{agent_command, AgentRun, ExecHelper};
use crate::fakepve::{workspace_root, AgentFiles, AgentOptions, FakePve};
use crate::guestbed::GuestBed;

/// Copy a file or a folder tree (`cp -a`).
pub fn copy_tree(from: &Path, to: &Path) {
    let ok = std::process::Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .unwrap_or_else(|e| panic!("cannot run cp: {e}"))
        .success();
    assert!(ok, "cp -a {} {} failed", from.display(), to.display());
}

/// Put the package's default bootstrap profile and check pack into an agent's folders, as the
/// package installs them ([`AgentFiles::write`] does; what is there already stays).
pub fn install_default_profile_and_checks(files: &AgentFiles) {
    let root = workspace_root();
    for (from, to) in [
        (
            root.join("packaging/bootstrap.d/default"),
            files.bootstrap_dir.join("default"),
        ),
        (
            root.join("packaging/checks.d/default.toml"),
            files.checks_dir.join("default.toml"),
        ),
    ] {
        if !to.exists() {
            copy_tree(&from, &to);
        }
    }
    // `cp -a` keeps the checkout's modes; the agent refuses what group or others may write.
    let ok = std::process::Command::new("chmod")
        .arg("-R")
        .arg("go-w")
        .arg(&files.bootstrap_dir)
        .arg(&files.checks_dir)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "chmod -R go-w of the profile and check folders failed");
}

/// Real seconds per PVE second in a world whose scenario does not set its own.
pub const TIME_SCALE: f64 = 0.01;

/// The fake PVE, the guest bed, the agent's files and the exec helper.
pub struct World {
    /// The root exec helper the agent's LXC execs go through (`None` when the agent options
    /// said `exec_helper: false`). Declared first, so it is killed before the rest goes.
    pub helper: Option<ExecHelper>,
    /// The fake PVE.
    pub pve: FakePve,
    /// The guest bed (its `pct` wrapper goes first on the agent's `PATH`).
    pub bed: GuestBed,
    /// The agent's configuration and folders.
    pub files: AgentFiles,
}

/// Tasks take time, as on a node: a scenario that leaves `time_scale` at 0 gets 0.01 real
/// seconds per PVE second, a container restore of 30 PVE seconds and a destroy of 10, so every
/// task is still running when PVE answers the request that started it.
pub fn tasks_take_time(scenario: &mut Value) {
    if scenario["time_scale"].as_f64().unwrap_or(0.0) == 0.0 {
        scenario["time_scale"] = serde_json::json!(TIME_SCALE);
        if scenario.get("attrs").is_none_or(Value::is_null) {
            scenario["attrs"] = serde_json::json!({});
        }
        let attrs = &mut scenario["attrs"];
        if attrs.get("ct_secs").is_none() {
            attrs["ct_secs"] = serde_json::json!({"create": 30, "destroy": 10});
        }
    }
}

/// The environment the agent and its exec helper need on `bed`: on the busybox bed, whose
/// containers run in the node's user namespace, the test hook that says so (a group's lab then
/// does not require their own user namespace with PVE's idmap); nothing on the real bed.
pub fn bed_env(bed: &GuestBed) -> Vec<(&'static str, &'static str)> {
    if bed.is_real() {
        Vec::new()
    } else {
        vec![("FELHOM_AGENT_BED_HOST_USERNS", "1")]
    }
}

/// `PATH` with the bed's `pct` first.
pub fn bed_path(bed: &GuestBed) -> String {
    format!(
        "{}:{}",
        bed.bin_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

impl World {
    /// A world whose selftest source is the scenario's QEMU backup ([`crate::fakepve::QEMU_BACKUP`],
    /// the demo's config), restored in `restore_secs` PVE seconds, whose guest agent behaves as
    /// `guest` says (see `add_qemu_backup`).
    pub fn qemu(restore_secs: u32, guest: Value) -> World {
        let mut s = crate::fakepve::demo_scenario();
        s["attrs"] = serde_json::json!({"qemu_restore_secs": restore_secs});
        crate::fakepve::add_qemu_backup(&mut s, crate::fakepve::qemu_backup_config(), guest);
        let opts = AgentOptions {
            selftest_source: Some(crate::fakepve::QEMU_BACKUP.to_string()),
            ..AgentOptions::default()
        };
        World::with_options(s, &opts)
    }

    /// The transactions `journal --json` lists (it must exit 0).
    pub fn journal(&self) -> Vec<Value> {
        let run = self.agent(&["journal", "--json"]);
        assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
        run.json()["transactions"]
            .as_array()
            .expect("transactions")
            .clone()
    }

    /// Transaction `txn` as `journal --json` lists it.
    pub fn journal_txn(&self, txn: &str) -> Value {
        self.journal()
            .into_iter()
            .find(|t| t["txn"] == txn)
            .unwrap_or_else(|| panic!("transaction {txn} not in the journal"))
    }

    /// A world for `scenario` with these agent options.
    ///
    /// The fake and the bed are joined ([`GuestBed::join_scenario`]): every backup of the
    /// scenario restores a guest with a real root filesystem (unless its volume says
    /// `"guest": false`), the fake keeps each container's state for the `pct` stand-in, and a
    /// VM's guest agent runs commands in its root filesystem.
    /// Tasks take time ([`tasks_take_time`]). Unless `opts.exec_helper` is false, the agent
    /// is split as on a node: its execs into containers go to an exec helper process of this
    /// world ([`World::helper`]), which alone runs the bed's `pct`.
    pub fn with_options(scenario: Value, opts: &AgentOptions) -> World {
        World::with_bed(scenario, opts, GuestBed::new())
    }

    /// [`real`](Self::real) for a test that needs real guests: `None` after printing why this
    /// machine has none ("skipped on this machine: …"; with `FELHOM_REQUIRE_REAL_GUESTS=1`
    /// `real` panics instead, so `tests/run.sh` never skips).
    pub fn real_or_skip(scenario: Value, opts: &AgentOptions) -> Option<World> {
        match World::real(scenario, opts) {
            Ok(w) => Some(w),
            Err((reason, _)) => {
                eprintln!("skipped on this machine: {reason}");
                None
            }
        }
    }

    /// [`World::with_options`] on real guests: the containers the fake restores are real LXC
    /// containers running Debian with systemd ([`GuestBed::new_real`]). `Err` with the reason
    /// and a world on the busybox bed when LXC does not work here (the reason is printed; with
    /// `FELHOM_REQUIRE_REAL_GUESTS=1` it panics instead). Each world on real guests adds a
    /// line `real guests: <test>` to the test reports (`tests/run.sh` counts them).
    pub fn real(scenario: Value, opts: &AgentOptions) -> Result<World, (String, World)> {
        match GuestBed::new_real() {
            Ok(bed) => {
                report_real_guests();
                Ok(World::with_bed(scenario, opts, bed))
            }
            Err((reason, bed)) => Err((reason, World::with_bed(scenario, opts, bed))),
        }
    }

    /// [`World::with_options`] with real VMs: a VM whose guest spec says `"real": true` runs
    /// in a real QEMU with Debian 12 and the real guest agent ([`GuestBed::new_real_vm`]).
    /// `None` after printing why this machine has no real VM (with
    /// `FELHOM_REQUIRE_REAL_GUESTS=1` it panics instead). Adds a line `real guests: <test>` to
    /// the test reports.
    pub fn real_vm_or_skip(scenario: Value, opts: &AgentOptions) -> Option<World> {
        World::on_real_bed_or_skip(GuestBed::new_real_vm(), scenario, opts)
    }

    /// A world on `bed` (reported as real guests), or `None` after printing why there is none.
    fn on_real_bed_or_skip(
        bed: Result<GuestBed, (String, GuestBed)>,
        scenario: Value,
        opts: &AgentOptions,
    ) -> Option<World> {
        match bed {
            Ok(bed) => {
                report_real_guests();
                Some(World::with_bed(scenario, opts, bed))
            }
            Err((reason, _)) => {
                eprintln!("skipped on this machine: {reason}");
                None
            }
        }
    }

    /// [`World::with_options`] with real containers and real VMs ([`GuestBed::new_real_with_vm`]);
    /// `None` after printing why not (a panic with `FELHOM_REQUIRE_REAL_GUESTS=1`).
    pub fn real_with_vm_or_skip(scenario: Value, opts: &AgentOptions) -> Option<World> {
        World::on_real_bed_or_skip(GuestBed::new_real_with_vm(), scenario, opts)
    }

    /// [`World::with_options`] with this bed.
    pub fn with_bed(mut scenario: Value, opts: &AgentOptions, bed: GuestBed) -> World {
        tasks_take_time(&mut scenario);
        bed.join_scenario(&mut scenario);
        let pve = FakePve::start(scenario);
        let files = AgentFiles::write(&pve, opts);
        install_default_profile_and_checks(&files);
        let helper = files.exec_socket.as_ref().map(|socket| {
            ExecHelper::start_env(&files.config_path, socket, &bed_path(&bed), &bed_env(&bed))
        });
        World {
            helper,
            pve,
            bed,
            files,
        }
    }

    /// Start the exec helper again (after a change of `agent.toml`: it reads its config once).
    pub fn restart_helper(&mut self) {
        self.restart_helper_env(&[]);
    }

    /// [`World::restart_helper`] with extra environment variables for the helper.
    pub fn restart_helper_env(&mut self, env: &[(&str, &str)]) {
        let socket = self
            .files
            .exec_socket
            .clone()
            .unwrap_or_else(|| panic!("this world has no exec helper (exec_helper: false)"));
        if let Some(old) = self.helper.take() {
            old.kill();
        }
        let _ = std::fs::remove_file(&socket);
        let mut env = env.to_vec();
        env.extend(bed_env(&self.bed));
        self.helper = Some(ExecHelper::start_env(
            &self.files.config_path,
            &socket,
            &bed_path(&self.bed),
            &env,
        ));
    }

    /// The exec helper (panics when the world has none).
    pub fn helper(&self) -> &ExecHelper {
        self.helper
            .as_ref()
            .unwrap_or_else(|| panic!("this world has no exec helper (exec_helper: false)"))
    }

    /// Assert that every `pct exec` and `pct push` so far was started by this world's exec
    /// helper, never by the agent, and return how many there were. The agent's `PATH` holds the
    /// bed's `pct` too, so an agent that ran `pct` itself would be seen here.
    pub fn assert_pct_only_from_helper(&self) -> usize {
        let helper = self.helper();
        let calls: Vec<_> = self
            .bed
            .pct_calls()
            .into_iter()
            .filter(|c| c.sub == "exec" || c.sub == "push")
            .collect();
        let strays: Vec<_> = calls
            .iter()
            .filter(|c| c.parent_pid != helper.pid() || !c.parent_cmdline.contains(" exec-helper "))
            .collect();
        assert!(
            strays.is_empty(),
            "pct exec/push started by a process other than the exec helper (pid {}): {strays:#?}",
            helper.pid()
        );
        calls.len()
    }

    /// A world for `scenario` with the default agent options.
    pub fn new(scenario: Value) -> World {
        World::with_options(scenario, &AgentOptions::default())
    }

    /// The demo scenario's world.
    pub fn demo() -> World {
        World::new(crate::fakepve::demo_scenario())
    }

    /// `PATH` for the agent: the bed's `pct` first.
    pub fn path(&self) -> String {
        bed_path(&self.bed)
    }

    /// The agent command for this world (config and `PATH` set).
    pub fn command(&self) -> std::process::Command {
        let mut cmd = agent_command(&self.files.config_path);
        cmd.env("PATH", self.path()).envs(bed_env(&self.bed));
        cmd
    }

    /// Run the agent with `args` and wait for it.
    pub fn agent(&self, args: &[&str]) -> AgentRun {
        self.command()
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run the agent: {e}"))
            .into()
    }

    /// The agent's state folder.
    pub fn state_dir(&self) -> PathBuf {
        self.files.state_dir.clone()
    }

    /// The messages a command line run spooled for the daemon to carry to the hub (each a
    /// frame as written), sorted.
    pub fn spooled(&self) -> Vec<String> {
        let dir = self.state_dir().join("outbox").join("spool");
        let mut out: Vec<String> = std::fs::read_dir(&dir)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "msg"))
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default()
            .into_iter()
            .map(|p| std::fs::read_to_string(p).expect("read spooled message"))
            .collect();
        out.sort();
        out
    }
}

/// Adds the line `real guests: <test>` to the test reports (`tests/run.sh` counts them).
fn report_real_guests() {
    let name = std::thread::current()
        .name()
        .unwrap_or("a test")
        .to_string();
    crate::report(&format!("real guests: {name}"));
}
