//! The fakepve test bed: one fake Proxmox VE API per [`FakePve`], served over real HTTPS on
//! its own loopback address, set up from a scenario and driven through the control endpoint of
//! `tests/fakepve/scenario.py`.
//!
//! A scenario is JSON (see `tests/fakepve/README.md`); start from [`demo_scenario`] and change
//! what a test needs. [`FakePve::start`] gives each instance a fresh 127.x.y.z host, a
//! temporary directory (the live files, the log, and a `private/` folder of mode 0700 with the
//! scenario file, the certificate, its key and the control secret) and a free port; dropping
//! the handle stops the process. [`AgentFiles`] writes an `agent.toml`, the token secret file
//! and a `.vmlist` for the agent under test.
//!
//! Token secrets and the control secret never appear in panics or in the `Debug` output of
//! anything here.

use std::fmt;
use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::{json, Value};
use tempfile::TempDir;

/// How long the fake may take from spawn to its ready line. It is ready in well under a second
/// on a quiet machine; with eight tests at once beside the real guests' boots on two cores, a
/// start was seen to take over 20 s. A fake that never starts still fails here, only later.
pub const READY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the fake may take to exit after SIGTERM before it is killed.
pub const TERM_GRACE: Duration = Duration::from_secs(5);
/// Read and write timeout of one control request.
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(30);
/// The fake's API prefix.
pub const API_PREFIX: &str = "/api2/json";
/// The folder, in a fake's temporary directory, of what holds a secret (its certdir).
const PRIVATE_DIR: &str = "private";

/// The root of the workspace (the parent of the `tests` crate).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The environment variable that moves [`state_base`].
pub const STATE_BASE_ENV: &str = "FELHOM_TEST_STATE_BASE";

/// Where the bed makes the agent's folders (config, state dir): `$FELHOM_TEST_STATE_BASE`, else
/// cargo's `target/tmp` beside the running test binary (what `CARGO_TARGET_TMPDIR` names for
/// integration tests), else, when the checkout itself is in such a place (a clone under `/tmp`),
/// [`PERSISTENT_STATE_BASE`]. The agent refuses a `state_dir` that does not survive a reboot
/// (under `/tmp`, `/run`, `/dev/shm`, or on tmpfs/ramfs); this panics when even the fallback is
/// such a folder.
pub fn state_base() -> PathBuf {
    let base = match std::env::var_os(STATE_BASE_ENV) {
        Some(p) => PathBuf::from(p),
        None => {
            // <target>/<profile>/deps/<test binary>
            let exe = std::env::current_exe()
                .unwrap_or_else(|e| panic!("cannot find the running test binary: {e}"));
            let target_tmp = exe
                .ancestors()
                .nth(3)
                .map(|target| target.join("tmp"))
                .unwrap_or_else(|| workspace_root().join("target").join("tmp"));
            fs::create_dir_all(&target_tmp).unwrap_or_else(|e| {
                panic!(
                    "cannot create the test state base {}: {e}",
                    target_tmp.display()
                )
            });
            if felhom_agent::config::state_dir_volatility(&target_tmp).is_some() {
                PathBuf::from(PERSISTENT_STATE_BASE)
            } else {
                target_tmp
            }
        }
    };
    fs::create_dir_all(&base)
        .unwrap_or_else(|e| panic!("cannot create the test state base {}: {e}", base.display()));
    if let Some(why) = felhom_agent::config::state_dir_volatility(&base) {
        panic!(
            "the test state base {} {why}: the agent would refuse every state_dir in it; set \
             {STATE_BASE_ENV} to a folder on persistent disk",
            base.display()
        );
    }
    base
}

/// The test state base when the checkout is in a folder the agent refuses as a `state_dir`
/// (`/var/tmp` survives a reboot, so the agent accepts it). Each test's folder in it is a
/// temporary directory removed when the test ends.
pub const PERSISTENT_STATE_BASE: &str = "/var/tmp/felhom-agent-tests";

/// The folder of the scenario files, `tests/fakepve/scenarios`.
pub fn scenarios_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fakepve/scenarios")
}

/// The scenario file `tests/fakepve/scenarios/<name>.json`.
pub fn load_scenario(name: &str) -> Value {
    let path = scenarios_dir().join(format!("{name}.json"));
    let text = fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read scenario {}: {e}", path.display()));
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("scenario {} is not JSON: {e}", path.display()))
}

/// The demo scenario: pool `felhom` with 200 (lxc, running) and 300 (qemu); foreign 101 (lxc,
/// running), 990000 (qemu) and 990001 (lxc); one backup of 200 on `local`; the pool token.
pub fn demo_scenario() -> Value {
    load_scenario("demo")
}

/// The demo pool without its VM (300, which has no backup), with these containers added
/// (vmid, name), each with a backup on `local`, every backup made an hour ago: a pool whose
/// guests' backups are all due for a restore test.
pub fn pool_with_backups(extra: &[(u32, &str)]) -> Value {
    let mut scenario = demo_scenario();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let guests = scenario["guests"]
        .as_array_mut()
        .unwrap_or_else(|| panic!("the demo scenario has no guests"));
    guests.retain(|g| g["vmid"] != json!(300));
    for (vmid, name) in extra {
        guests.push(
            json!({"vmid": vmid, "type": "lxc", "name": name, "node": "pve1",
            "status": "running", "pool": "felhom",
            "config": {"unprivileged": "1", "memory": "512"}}),
        );
    }
    let volumes = scenario["volumes"]["local"]
        .as_array_mut()
        .unwrap_or_else(|| panic!("the demo scenario has no volumes on local"));
    for v in volumes.iter_mut() {
        v["ctime"] = json!(now - 3600);
    }
    for (vmid, _) in extra {
        volumes.push(json!({
            "volname": format!("backup/vzdump-lxc-{vmid}-2026_12_01-00_00_00.tar.zst"),
            "vmid": vmid, "ctime": now - 3600,
            "config": {"unprivileged": "1", "memory": "512"}}));
    }
    scenario
}

/// The QEMU backup [`add_qemu_backup`] puts on `local`: a backup of the pool VM 300.
pub const QEMU_BACKUP: &str = "local:backup/vzdump-qemu-300-2026_01_01-00_00_00.vma.zst";

/// The config stored with [`QEMU_BACKUP`] by default: a VM with the guest agent enabled, one
/// disk, two NICs on bridges, a name, tags and a description.
pub fn qemu_backup_config() -> Value {
    json!({
        "name": "felhom-vm",
        "agent": "1",
        "ostype": "l26",
        "memory": "2048",
        "scsi0": "local-lvm:vm-300-disk-0,size=8G",
        "net0": "virtio=BC:24:11:00:03:00,bridge=vmbr0",
        "net1": "virtio=BC:24:11:00:03:01,bridge=vmbr1,tag=20",
        "tags": "customer;prod",
        "description": "customer VM of the demo pool",
    })
}

/// Add [`QEMU_BACKUP`] to `scenario` with this stored `config` and guest bed spec (`guest`:
/// `{"agent": bool, "boot_secs", "start_secs", "stop_secs"}`, PVE seconds; see
/// tests/fakepve/README.md).
pub fn add_qemu_backup(scenario: &mut Value, config: Value, guest: Value) {
    let volname = QEMU_BACKUP
        .strip_prefix("local:")
        .unwrap_or(QEMU_BACKUP)
        .to_string();
    scenario["volumes"]["local"]
        .as_array_mut()
        .unwrap_or_else(|| panic!("the scenario has no volumes on local"))
        .push(json!({"volname": volname, "vmid": 300, "size": 734003200, "config": config, "guest": guest}));
}

/// Give `scenario` a cluster `datacenter.cfg` with these keys, in the file's own syntax (for
/// example `{"user-tag-access": "user-allow=existing", "registered-tags": "felhom"}`): the fake
/// enforces its tag policy on guest creates, restores and config changes and keeps the file
/// live beside its `.vmlist` ([`FakePve::datacenter_cfg_path`]).
pub fn with_datacenter_cfg(scenario: &mut Value, keys: Value) {
    scenario["datacenter_cfg"] = keys;
}

/// The Python interpreter of the fakepve venv: `$FELHOM_FAKEPVE_PYTHON`, else
/// `<workspace>/.fakepve-venv/bin/python`. Panics when it does not exist.
pub fn fakepve_python() -> PathBuf {
    let path = std::env::var_os("FELHOM_FAKEPVE_PYTHON")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".fakepve-venv/bin/python"));
    if !path.exists() {
        panic!(
            "fakepve's Python is missing at {}: run tests/run.sh (it installs fakepve into \
             .fakepve-venv and sets FELHOM_FAKEPVE_PYTHON)",
            path.display()
        );
    }
    path
}

/// The wrapper script, `tests/fakepve/scenario.py`.
pub fn scenario_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fakepve/scenario.py")
}

static INSTANCE: AtomicU32 = AtomicU32::new(0);

/// A loopback address of its own for the `instance`-th fake of process `pid`: 127.X.Y.Z with
/// X in 1..=247, Z in 1..=254, never in 127.0.0.0/16 (where 127.0.0.1 and fakepve's own
/// `next_loopback` live). Distinct for distinct (pid mod 16000, instance mod 1000).
pub fn loopback_host(pid: u32, instance: u32) -> String {
    let slot = (pid % 16_000) * 1_000 + instance % 1_000;
    let per_x = 256 * 254;
    let x = 1 + slot / per_x;
    let rest = slot % per_x;
    format!("127.{x}.{}.{}", rest / 254, 1 + rest % 254)
}

/// One request the fake received, as its control endpoint reports it. `body` and `query` have
/// secrets replaced by `***` (fakepve's redaction); bodies are cut at 64 KiB.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedRequest {
    /// `GET`, `POST`, `PUT`, `DELETE`, …
    pub method: String,
    /// The full path, e.g. `/api2/json/nodes/pve1/lxc/200`.
    pub path: String,
    /// The query string without `?` (empty when there was none).
    pub query: String,
    /// The request body as text.
    pub body: String,
}

/// When the fake began and ended one API answer (seconds on one monotonic clock).
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerTiming {
    /// `GET`, `POST`, …
    pub method: String,
    /// The full path.
    pub path: String,
    /// The answer began (the request was read).
    pub start: f64,
    /// The answer was ready.
    pub end: f64,
}

/// The round trips one after the other among `timings`: the longest chain of answers each of
/// which began only after the one before it had ended (answers that overlap went out at once).
pub fn sequential_round_trips(timings: &[AnswerTiming]) -> usize {
    let mut sorted: Vec<&AnswerTiming> = timings.iter().collect();
    sorted.sort_by(|a, b| a.start.total_cmp(&b.start));
    let mut depth: Vec<usize> = Vec::with_capacity(sorted.len());
    for (i, t) in sorted.iter().enumerate() {
        let before = (0..i)
            .filter(|&j| sorted[j].end <= t.start)
            .map(|j| depth[j])
            .max()
            .unwrap_or(0);
        depth.push(before + 1);
    }
    depth.into_iter().max().unwrap_or(0)
}

impl RecordedRequest {
    /// True for anything but `GET` and `HEAD`.
    pub fn is_write(&self) -> bool {
        !matches!(self.method.as_str(), "GET" | "HEAD")
    }

    /// The path below `/api2/json` (or the path itself when it is not under it).
    pub fn api_path(&self) -> &str {
        self.path.strip_prefix(API_PREFIX).unwrap_or(&self.path)
    }

    /// True when the request targets guest `vmid` (`/nodes/<node>/{lxc,qemu}/<vmid>[/…]`).
    pub fn targets_vmid(&self, vmid: u32) -> bool {
        let parts: Vec<&str> = self.api_path().split('/').collect();
        matches!(
            parts.as_slice(),
            ["", "nodes", _, "lxc" | "qemu", id, ..] if *id == vmid.to_string()
        )
    }

    /// The value of a form field in the body, or of a query parameter (first match, not
    /// percent-decoded).
    pub fn param(&self, name: &str) -> Option<&str> {
        self.body
            .split('&')
            .chain(self.query.split('&'))
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v)
    }
}

/// A control request the fake refused (HTTP status and its `error` message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlError {
    /// HTTP status of the control answer (0: no answer at all).
    pub status: u16,
    /// What went wrong.
    pub message: String,
}

impl fmt::Display for ControlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "control answered {}: {}", self.status, self.message)
    }
}

impl std::error::Error for ControlError {}

/// The ready line of `scenario.py`.
#[derive(Debug, Clone, serde::Deserialize)]
struct Ready {
    url: String,
    cafile: PathBuf,
    sha256: String,
    control: String,
    /// The file (mode 0600) holding the secret every control request carries.
    control_secret_file: PathBuf,
    pid: u32,
}

/// A running fakepve: one Python process serving HTTPS on its own loopback host.
///
/// Dropping it sends SIGTERM, waits up to [`TERM_GRACE`], then kills and reaps the process.
pub struct FakePve {
    child: Option<crate::fakeproc::FakeProc>,
    stdout_reader: Option<JoinHandle<()>>,
    ready: Ready,
    host: String,
    port: u16,
    control_addr: String,
    /// The control endpoint's secret, read from `control_secret_file`. Never print it.
    control_secret: String,
    scenario: Value,
    dir: TempDir,
}

impl fmt::Debug for FakePve {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FakePve")
            .field("url", &self.ready.url)
            .field("control", &self.ready.control)
            .field("pid", &self.ready.pid)
            .finish_non_exhaustive()
    }
}

impl FakePve {
    /// Start a fake from `scenario` (its `host` and `certdir` are replaced by this instance's
    /// own; `port` 0 unless the scenario sets another). Panics with the fake's log when it does
    /// not come up within [`READY_TIMEOUT`].
    pub fn start(scenario: Value) -> FakePve {
        let python = fakepve_python();
        let script = scenario_script();
        let mut scenario = scenario;
        let obj = scenario
            .as_object_mut()
            .unwrap_or_else(|| panic!("a fakepve scenario must be a JSON object"));
        let host = loopback_host(std::process::id(), INSTANCE.fetch_add(1, Ordering::SeqCst));
        let dir = crate::scratch_tempdir("fakepve-");
        // The instance's folder stays enterable by others (an agent that switched to its user
        // reads the live `.vmlist` and `user.cfg` in it); what holds a secret (the scenario's
        // token secrets, the TLS key, the control secret) goes into a folder of its own that
        // only root enters, made with that mode.
        let certdir = dir.path().join(PRIVATE_DIR);
        {
            use std::os::unix::fs::DirBuilderExt;
            fs::DirBuilder::new()
                .mode(0o700)
                .create(&certdir)
                .unwrap_or_else(|e| panic!("cannot create {}: {e}", certdir.display()));
        }
        obj.insert("host".into(), json!(host));
        obj.insert("certdir".into(), json!(certdir));
        if !obj.get("port").is_some_and(Value::is_u64) {
            obj.insert("port".into(), json!(0));
        }
        // The live `.vmlist`, kept by the fake as pmxcfs keeps it on a node.
        let vmlist_path = dir.path().join("vmlist");
        let extra = obj
            .get("vmlist_extra")
            .cloned()
            .unwrap_or_else(|| json!([]));
        obj.insert(
            "vmlist".into(),
            json!({"path": vmlist_path, "extra": extra}),
        );
        // Beside it, the live `user.cfg` (users, tokens, pools, ACLs), as in /etc/pve.
        obj.insert(
            "user_cfg".into(),
            json!({"path": dir.path().join("user.cfg")}),
        );
        // A scenario's `datacenter_cfg` (the cluster's tag policy, ...) is written beside them as
        // `datacenter.cfg`, unless it names its own path.
        if let Some(dc) = obj.get_mut("datacenter_cfg").and_then(Value::as_object_mut) {
            dc.entry("path")
                .or_insert_with(|| json!(dir.path().join("datacenter.cfg")));
        }
        // And the containers' own configs (`nodes/<node>/lxc/<vmid>.conf`), as in /etc/pve.
        obj.insert("ct_conf".into(), json!({"dir": dir.path().join("nodes")}));
        let scenario_path = certdir.join("scenario.json");
        write_private(
            &scenario_path,
            serde_json::to_string_pretty(&scenario)
                .unwrap_or_else(|e| panic!("cannot serialise the scenario: {e}"))
                .as_bytes(),
        );
        let log_path = dir.path().join("fakepve.log");
        let log = fs::File::create(&log_path)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", log_path.display()));
        let (mut child, stdout) = crate::fakeproc::FakeProc::start(
            &python,
            &script,
            &scenario_path,
            &workspace_root(),
            log,
        )
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {} {}: {e}; run tests/run.sh",
                python.display(),
                script.display()
            )
        });
        let stdout = Some(stdout);
        let (tx, rx) = mpsc::channel::<String>();
        let stdout_reader = std::thread::spawn(move || {
            let Some(stdout) = stdout else { return };
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            // Keep draining, so a stray write can never block the fake.
            for _ in lines {}
        });
        let line = match rx.recv_timeout(READY_TIMEOUT) {
            Ok(line) => line,
            Err(e) => {
                let status = child.kill_and_wait();
                let _ = stdout_reader.join();
                panic!(
                    "fakepve did not become ready ({}; exit: {status:?}); its log:\n{}",
                    match e {
                        mpsc::RecvTimeoutError::Timeout =>
                            format!("no ready line within {READY_TIMEOUT:?}"),
                        mpsc::RecvTimeoutError::Disconnected =>
                            "it closed stdout without a ready line".to_string(),
                    },
                    read_log(&log_path)
                );
            }
        };
        let ready: Ready = match serde_json::from_str(&line) {
            Ok(r) => r,
            Err(e) => {
                let _ = child.kill_and_wait();
                panic!("fakepve's ready line {line:?} is not what scenario.py prints: {e}");
            }
        };
        let (ready_host, port) = split_host_port(
            ready
                .url
                .strip_prefix("https://")
                .unwrap_or_else(|| panic!("fakepve url {} is not https", ready.url)),
        );
        assert_eq!(ready_host, host, "fakepve listens on another host");
        let control_addr = ready
            .control
            .strip_prefix("http://")
            .unwrap_or_else(|| panic!("fakepve control {} is not http", ready.control))
            .to_string();
        // The fake runs as root and its control port is reachable by every local user: it
        // answers only requests carrying this secret, which it wrote to a file only its own
        // user may read.
        let control_secret = match fs::read_to_string(&ready.control_secret_file) {
            Ok(text) => text.trim().to_string(),
            Err(e) => {
                let _ = child.kill_and_wait();
                panic!(
                    "cannot read the fake's control secret {}: {e}",
                    ready.control_secret_file.display()
                );
            }
        };
        FakePve {
            child: Some(child),
            stdout_reader: Some(stdout_reader),
            ready,
            host,
            port,
            control_addr,
            control_secret,
            scenario,
            dir,
        }
    }

    /// Start the demo scenario unchanged.
    pub fn demo() -> FakePve {
        FakePve::start(demo_scenario())
    }

    /// `https://<host>:<port>`, without a trailing slash.
    pub fn url(&self) -> &str {
        &self.ready.url
    }

    /// The API base, `https://<host>:<port>/api2/json`.
    pub fn api_url(&self) -> String {
        format!("{}{API_PREFIX}", self.ready.url)
    }

    /// The loopback address this instance listens on.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The HTTPS port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The PEM certificate the fake serves (self-signed; usable as the CA file).
    pub fn cafile(&self) -> &Path {
        &self.ready.cafile
    }

    /// Lowercase hex SHA-256 of the served certificate's DER (the pin, no colons).
    pub fn sha256_hex(&self) -> &str {
        &self.ready.sha256
    }

    /// The pin as PVE shows it: `AB:CD:…`.
    pub fn fingerprint_colons(&self) -> String {
        self.ready
            .sha256
            .as_bytes()
            .chunks(2)
            .map(|c| String::from_utf8_lossy(c).to_uppercase())
            .collect::<Vec<_>>()
            .join(":")
    }

    /// The control endpoint, `http://<host>:<port>`.
    pub fn control_url(&self) -> &str {
        &self.ready.control
    }

    /// The file (mode 0600, in the fake's certdir) holding the secret every control request
    /// must carry as `Authorization: Bearer <secret>`.
    pub fn control_secret_file(&self) -> &Path {
        &self.ready.control_secret_file
    }

    /// The fake's process id.
    pub fn pid(&self) -> u32 {
        self.ready.pid
    }

    /// This instance's temporary directory (live files, log; the secrets in
    /// [`private_dir`](Self::private_dir)).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The folder (mode 0700) of this instance's secrets: the scenario file, the certificate
    /// and its key, the control secret.
    pub fn private_dir(&self) -> PathBuf {
        self.dir.path().join(PRIVATE_DIR)
    }

    /// The scenario file the fake was started from (mode 0600: it holds the token secrets).
    pub fn scenario_file(&self) -> PathBuf {
        self.private_dir().join("scenario.json")
    }

    /// The fake's live `.vmlist` (pmxcfs's `/etc/pve/.vmlist`), rewritten as guests come and go.
    pub fn vmlist_path(&self) -> PathBuf {
        self.dir.path().join("vmlist")
    }

    /// The fake's live `nodes` folder (pmxcfs's `/etc/pve/nodes`): every container's config as
    /// `<node>/lxc/<vmid>.conf`, rewritten as containers come, change and go.
    pub fn nodes_dir(&self) -> PathBuf {
        self.dir.path().join("nodes")
    }

    /// The guest bed's lxcpath (`guest_bed.lxc_path` of the scenario), if the fake is joined to
    /// a bed: its running containers' LXC monitor stand-ins hold their command sockets there.
    pub fn bed_lxc_path(&self) -> Option<PathBuf> {
        self.scenario
            .get("guest_bed")
            .and_then(|b| b.get("lxc_path"))
            .and_then(Value::as_str)
            .map(PathBuf::from)
    }

    /// The fake's live `user.cfg` (pmxcfs's `/etc/pve/user.cfg`): users, tokens, pools with
    /// their members, ACLs; rewritten at once when pool membership changes.
    pub fn user_cfg_path(&self) -> PathBuf {
        self.dir.path().join("user.cfg")
    }

    /// The fake's live `datacenter.cfg` (pmxcfs's `/etc/pve/datacenter.cfg`), written when the
    /// scenario has `datacenter_cfg` (see [`with_datacenter_cfg`]).
    pub fn datacenter_cfg_path(&self) -> PathBuf {
        self.scenario["datacenter_cfg"]["path"]
            .as_str()
            .map(PathBuf::from)
            .unwrap_or_else(|| self.dir.path().join("datacenter.cfg"))
    }

    /// Every guest start request the fake received, in order: the vmid and the guest's config
    /// (values as text) at the moment the request came in, i.e. what the guest started with.
    pub fn start_configs(&self) -> Vec<(u32, serde_json::Map<String, Value>)> {
        let v = self.call("start_configs", json!([]), json!({}));
        v.as_array()
            .expect("start_configs is a list")
            .iter()
            .map(|e| {
                (
                    e["vmid"].as_u64().expect("vmid") as u32,
                    e["config"].as_object().cloned().unwrap_or_default(),
                )
            })
            .collect()
    }

    /// Every start in which a guest's NICs reached a network as PVE wires them (a container NIC
    /// on a bridge, any VM NIC: see `_exposure` in `tests/fakepve/scenario.py`): the vmid and
    /// one line per NIC. Empty when every guest started without such a NIC.
    pub fn network_exposures(&self) -> Vec<(u32, Vec<String>)> {
        let v = self.call("start_configs", json!([]), json!({}));
        v.as_array()
            .expect("start_configs is a list")
            .iter()
            .filter_map(|e| {
                let lines: Vec<String> = e["exposed"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|l| l.as_str().map(str::to_string))
                            .collect()
                    })
                    .unwrap_or_default();
                (!lines.is_empty()).then(|| (e["vmid"].as_u64().expect("vmid") as u32, lines))
            })
            .collect()
    }

    /// Change the running fake's `datacenter.cfg` keys (merged into those it has, e.g.
    /// `{"user-tag-access": "user-allow=none"}`); the live file follows when the scenario had
    /// `datacenter_cfg`.
    pub fn set_datacenter_cfg(&self, keys: Value) {
        self.set(json!({ "datacenter_cfg": keys }));
    }

    /// The scenario as it was started (with this instance's host and certdir).
    pub fn scenario(&self) -> &Value {
        &self.scenario
    }

    /// The first pool of the scenario (`felhom` in the demo).
    pub fn pool(&self) -> String {
        match self.scenario.get("pools") {
            Some(Value::Array(a)) => a.first().and_then(Value::as_str).map(str::to_string),
            Some(Value::Object(o)) => o.keys().next().cloned(),
            _ => None,
        }
        .unwrap_or_else(|| panic!("the scenario has no pools"))
    }

    fn token(&self) -> (String, String) {
        let tokens = self
            .scenario
            .get("tokens")
            .and_then(Value::as_object)
            .filter(|t| !t.is_empty())
            .unwrap_or_else(|| panic!("the scenario has no tokens"));
        let (id, secret) = tokens
            .iter()
            .next()
            .unwrap_or_else(|| panic!("the scenario has no tokens"));
        let secret = secret
            .as_str()
            .unwrap_or_else(|| panic!("the secret of token {id} is not a string"));
        (id.clone(), secret.to_string())
    }

    /// The scenario's API token id (the first in key order if there are several).
    pub fn token_id(&self) -> String {
        self.token().0
    }

    /// The secret of [`token_id`](Self::token_id). Never print it.
    pub fn token_secret(&self) -> String {
        self.token().1
    }

    /// The `Authorization` header value for the scenario's token. Never print it.
    pub fn auth_header(&self) -> String {
        let (id, secret) = self.token();
        format!("PVEAPIToken={id}={secret}")
    }

    /// What the fake wrote to stderr so far.
    pub fn log(&self) -> String {
        read_log(&self.dir.path().join("fakepve.log"))
    }

    /// An async HTTPS client that trusts only this fake's certificate (rustls with ring).
    pub fn https_client(&self) -> reqwest::Client {
        https_client_for(self.cafile())
    }

    // ------------------------------------------------------------------- control

    fn control(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ControlError> {
        control_request(
            &self.control_addr,
            Some(&self.control_secret),
            method,
            path,
            body,
        )
    }

    /// A control request as this fake's own client sends it, but with `secret` in place of the
    /// fake's (`None`: no `Authorization` header): what a caller without the secret gets.
    pub fn control_with_secret(
        &self,
        secret: Option<&str>,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, ControlError> {
        control_request(&self.control_addr, secret, method, path, body)
    }

    /// Call any FakePve method through `/call`; the result as JSON (sets become lists, a guest
    /// its public fields). Panics when the fake refuses.
    pub fn call(&self, method: &str, args: Value, kwargs: Value) -> Value {
        self.try_call(method, args, kwargs)
            .unwrap_or_else(|e| panic!("fakepve call {method}: {e}"))
    }

    /// [`call`](Self::call), returning the refusal instead of panicking.
    pub fn try_call(
        &self,
        method: &str,
        args: Value,
        kwargs: Value,
    ) -> Result<Value, ControlError> {
        let args = if args.is_null() { json!([]) } else { args };
        let kwargs = if kwargs.is_null() { json!({}) } else { kwargs };
        let answer = self.control(
            "POST",
            "/call",
            Some(&json!({"method": method, "args": args, "kwargs": kwargs})),
        )?;
        Ok(answer.get("result").cloned().unwrap_or(Value::Null))
    }

    /// Set FakePve attributes through `/set` (dicts are merged into the ones there, a list
    /// given for a set becomes a set). Panics when the fake refuses.
    pub fn set(&self, attrs: Value) {
        if let Err(e) = self.try_set(attrs) {
            panic!("fakepve set: {e}");
        }
    }

    /// [`set`](Self::set), returning the refusal instead of panicking.
    pub fn try_set(&self, attrs: Value) -> Result<(), ControlError> {
        self.control("POST", "/set", Some(&attrs)).map(drop)
    }

    /// Set attributes of guest `vmid` through `/guest` (`status`, `pool`, `lock` keep the
    /// fake's bookkeeping in step; dicts such as `config` or `agent` are merged). Returns the
    /// guest's public fields. Panics when the fake refuses.
    pub fn guest_set(&self, vmid: u32, attrs: Value) -> Value {
        self.try_guest_set(vmid, attrs)
            .unwrap_or_else(|e| panic!("fakepve guest {vmid}: {e}"))
    }

    /// [`guest_set`](Self::guest_set), returning the refusal instead of panicking.
    pub fn try_guest_set(&self, vmid: u32, attrs: Value) -> Result<Value, ControlError> {
        self.control("POST", "/guest", Some(&json!({"vmid": vmid, "set": attrs})))
            .map(|v| v.get("result").cloned().unwrap_or(Value::Null))
    }

    /// The guest's public fields (`status`, `config`, `pool`, `lock`, `type`, …), or `None`
    /// when the fake has no guest `vmid`.
    pub fn guest(&self, vmid: u32) -> Option<Value> {
        Some(self.call("guest", json!([vmid]), Value::Null)).filter(|v| !v.is_null())
    }

    /// Make the next `times` requests (`None`: all) whose path ends with `suffix` fail with
    /// this status and message.
    pub fn fail(&self, method: &str, suffix: &str, status: u16, message: &str, times: Option<u32>) {
        self.call(
            "fail",
            json!([method, suffix]),
            json!({"status": status, "message": message, "times": times}),
        );
    }

    /// Make the next `times` requests (`None`: all) whose path ends with `suffix` fail with the
    /// catalogue error `error` (PVE's own wording, e.g. `restore_vmid_taken`, `no_quorum`).
    pub fn fail_with(&self, method: &str, suffix: &str, error: &str, times: Option<u32>) {
        self.call(
            "fail",
            json!([method, suffix]),
            json!({"error": error, "times": times}),
        );
    }

    /// The guest DELETEs that asked PVE to free more than the guest's config references
    /// (`destroy-unreferenced-disks` or `purge` not `0`), as the wrapper recorded them.
    pub fn destroy_violations(&self) -> Vec<String> {
        self.try_call("violations", json!([]), json!({}))
            .ok()
            .as_ref()
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The requests PVE's API schema rejects (unknown path or method, an unknown parameter, a
    /// value of the wrong type, format or length, a required one missing), as the wrapper
    /// recorded them: parameter names and PVE's reasons, never a value. Dropping the fake fails
    /// the test while any is recorded.
    pub fn schema_violations(&self) -> Vec<String> {
        self.try_call("schema_violation_list", json!([]), json!({}))
            .ok()
            .as_ref()
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The schema violations recorded so far, forgotten (a test that sent them on purpose).
    pub fn take_schema_violations(&self) -> Vec<String> {
        let seen = self.schema_violations();
        self.call("clear_schema_violations", json!([]), json!({}));
        seen
    }

    /// Every request the fake received, oldest first.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        let answer = self
            .control("GET", "/requests", None)
            .unwrap_or_else(|e| panic!("fakepve requests: {e}"));
        let items = answer
            .as_array()
            .unwrap_or_else(|| panic!("fakepve /requests is not a list"));
        items
            .iter()
            .map(|r| {
                let field = |k: &str| r.get(k).and_then(Value::as_str).unwrap_or("").to_string();
                RecordedRequest {
                    method: field("method"),
                    path: field("path"),
                    query: field("query"),
                    body: field("body"),
                }
            })
            .collect()
    }

    /// When each API answer began and ended (`GET /timings`), in the order the answers ended.
    pub fn timings(&self) -> Vec<AnswerTiming> {
        let answer = self
            .control("GET", "/timings", None)
            .unwrap_or_else(|e| panic!("fakepve timings: {e}"));
        answer
            .as_array()
            .unwrap_or_else(|| panic!("fakepve /timings is not a list"))
            .iter()
            .map(|t| AnswerTiming {
                method: t["method"].as_str().unwrap_or("").to_string(),
                path: t["path"].as_str().unwrap_or("").to_string(),
                start: t["start"].as_f64().unwrap_or(0.0),
                end: t["end"].as_f64().unwrap_or(0.0),
            })
            .collect()
    }

    /// The requests that could change something (not `GET`/`HEAD`).
    pub fn writes(&self) -> Vec<RecordedRequest> {
        self.requests()
            .into_iter()
            .filter(|r| r.is_write())
            .collect()
    }

    /// The `DELETE` requests aimed at guest `vmid` (and its sub-paths).
    pub fn deletes_for(&self, vmid: u32) -> Vec<RecordedRequest> {
        self.requests()
            .into_iter()
            .filter(|r| r.method == "DELETE" && r.targets_vmid(vmid))
            .collect()
    }

    /// The writes aimed at guest `vmid` (and its sub-paths).
    pub fn writes_for(&self, vmid: u32) -> Vec<RecordedRequest> {
        self.writes()
            .into_iter()
            .filter(|r| r.targets_vmid(vmid))
            .collect()
    }

    /// Every task the fake ran, oldest first (`upid`, `type`, `id`, `user`, `status`,
    /// `exitstatus`, `log`, …).
    pub fn tasks(&self) -> Vec<Value> {
        match self.control("GET", "/tasks", None) {
            Ok(Value::Array(a)) => a,
            Ok(other) => panic!("fakepve /tasks is not a list: {other}"),
            Err(e) => panic!("fakepve tasks: {e}"),
        }
    }

    /// The `.vmlist` entries of the scenario's guests: (vmid, node, type).
    pub fn vmlist_entries(&self) -> Vec<VmlistEntry> {
        vmlist_entries_of(&self.scenario)
    }

    /// Stop the fake now with SIGTERM (killed after [`TERM_GRACE`]) and return how it ended.
    pub fn terminate(mut self) -> ExitStatus {
        self.stop()
            .unwrap_or_else(|| panic!("fakepve was already stopped"))
    }

    fn stop(&mut self) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        let status = match child.wait_for(Duration::ZERO) {
            Some(status) => Some(status),
            None => {
                child.terminate();
                match child.wait_for(TERM_GRACE) {
                    Some(status) => Some(status),
                    None => child.kill_and_wait(),
                }
            }
        };
        if let Some(reader) = self.stdout_reader.take() {
            let _ = reader.join();
        }
        status
    }
}

impl Drop for FakePve {
    fn drop(&mut self) {
        // Every guest DELETE of every test frees only what the config references.
        let (violations, schema) = if std::thread::panicking() {
            (Vec::new(), Vec::new())
        } else {
            (self.destroy_violations(), self.schema_violations())
        };
        let _ = self.stop();
        assert!(
            violations.is_empty(),
            "guest DELETEs that free more than the config references: {violations:?}"
        );
        // Every request of every test is one PVE's API schema accepts.
        assert!(
            schema.is_empty(),
            "requests PVE's API schema rejects: {schema:#?}"
        );
        if std::thread::panicking() {
            eprintln!(
                "--- fakepve {} log ---\n{}--- end of fakepve log ---",
                self.ready.url,
                tail(&self.log(), 8 * 1024)
            );
        }
    }
}

fn tail(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

fn read_log(path: &Path) -> String {
    fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_else(|e| format!("(cannot read {}: {e})", path.display()))
}

fn split_host_port(addr: &str) -> (String, u16) {
    let (host, port) = addr
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("address {addr} has no port"));
    let port = port
        .trim_end_matches('/')
        .parse()
        .unwrap_or_else(|e| panic!("address {addr} has a bad port: {e}"));
    (host.to_string(), port)
}

/// Write `data` to `path` with mode 0600 (before any byte is written).
pub fn write_private(path: &Path, data: &[u8]) {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))
        .unwrap_or_else(|e| panic!("cannot chmod {}: {e}", path.display()));
    f.write_all(data)
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}

/// One plain HTTP/1.1 request to the control endpoint at `addr` (`host:port`), carrying
/// `secret` as `Authorization: Bearer <secret>` (`None`: no such header). A 2xx answer's JSON
/// body is returned; anything else becomes a [`ControlError`] (which never holds the secret).
fn control_request(
    addr: &str,
    secret: Option<&str>,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<Value, ControlError> {
    let no_answer = |message: String| ControlError { status: 0, message };
    let payload = body.map(Value::to_string).unwrap_or_default();
    let mut stream = TcpStream::connect(addr)
        .map_err(|e| no_answer(format!("cannot connect to {addr}: {e}")))?;
    let _ = stream.set_read_timeout(Some(CONTROL_TIMEOUT));
    let _ = stream.set_write_timeout(Some(CONTROL_TIMEOUT));
    let mut request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nAccept: application/json\r\n"
    );
    if let Some(secret) = secret {
        request.push_str(&format!("Authorization: Bearer {secret}\r\n"));
    }
    if body.is_some() {
        request.push_str("Content-Type: application/json\r\n");
    }
    request.push_str(&format!("Content-Length: {}\r\n\r\n", payload.len()));
    request.push_str(&payload);
    stream
        .write_all(request.as_bytes())
        .map_err(|e| no_answer(format!("cannot send {method} {path}: {e}")))?;
    let mut raw = Vec::new();
    stream
        .read_to_end(&mut raw)
        .map_err(|e| no_answer(format!("no answer to {method} {path}: {e}")))?;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| no_answer(format!("{method} {path}: the answer has no header end")))?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| no_answer(format!("{method} {path}: bad status line in {head:?}")))?;
    let chunked = head
        .lines()
        .any(|l| l.to_ascii_lowercase().starts_with("transfer-encoding:") && l.contains("chunked"));
    let mut content = raw[split + 4..].to_vec();
    if chunked {
        content = dechunk(&content);
    }
    let value: Value = if content.iter().all(u8::is_ascii_whitespace) {
        Value::Null
    } else {
        serde_json::from_slice(&content).map_err(|e| ControlError {
            status,
            message: format!(
                "{method} {path}: answer is not JSON ({e}): {}",
                String::from_utf8_lossy(&content)
            ),
        })?
    };
    if (200..300).contains(&status) {
        Ok(value)
    } else {
        Err(ControlError {
            status,
            message: value
                .get("error")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| value.to_string()),
        })
    }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = data.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size_text = String::from_utf8_lossy(&data[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .unwrap_or(0);
        if size == 0 || data.len() < eol + 2 + size {
            return out;
        }
        out.extend_from_slice(&data[eol + 2..eol + 2 + size]);
        data = data.get(eol + 2 + size + 2..).unwrap_or(&[]);
    }
}

/// One API request to `pve` with the scenario's token, a form body when `form` is not empty:
/// (HTTP status, JSON body).
pub async fn api_send(
    pve: &FakePve,
    method: reqwest::Method,
    path: &str,
    form: &[(&str, &str)],
) -> (u16, Value) {
    let mut req = pve
        .https_client()
        .request(method, format!("{}{path}", pve.api_url()))
        .header("Authorization", pve.auth_header());
    if !form.is_empty() {
        req = req
            .header("Content-Type", "application/x-www-form-urlencoded")
            .body(form_urlencode(form));
    }
    let resp = req.send().await.expect("request to fakepve");
    let status = resp.status().as_u16();
    let body = resp.json::<Value>().await.expect("JSON answer");
    (status, body)
}

/// [`api_send`] of a GET.
pub async fn api_get(pve: &FakePve, path: &str) -> (u16, Value) {
    api_send(pve, reqwest::Method::GET, path, &[]).await
}

/// Wait (up to 30 s) for task `upid` to stop; its exit status (`OK`, `WARNINGS: N`, an error).
pub async fn api_wait_task(pve: &FakePve, upid: &str) -> String {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (status, body) = api_get(pve, &format!("/nodes/pve1/tasks/{upid}/status")).await;
        assert_eq!(status, 200, "{body}");
        if body["data"]["status"] == "stopped" {
            return body["data"]["exitstatus"]
                .as_str()
                .unwrap_or("")
                .to_string();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "task {upid} did not end"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// POST `form` to `path`, which starts a task, and wait for that task to end `OK`.
pub async fn api_post_ok(pve: &FakePve, path: &str, form: &[(&str, &str)]) {
    let (status, body) = api_send(pve, reqwest::Method::POST, path, form).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        api_wait_task(pve, body["data"].as_str().expect("UPID")).await,
        "OK"
    );
}

/// Restore [`QEMU_BACKUP`] into `vmid` (in the pool, on `local-lvm`) and start it: a running
/// bed VM when the fake is joined to a guest bed.
pub async fn start_qemu_copy(pve: &FakePve, vmid: u32) {
    let id = vmid.to_string();
    api_post_ok(
        pve,
        "/nodes/pve1/qemu",
        &[
            ("vmid", &id),
            ("archive", QEMU_BACKUP),
            ("storage", "local-lvm"),
            ("pool", "felhom"),
        ],
    )
    .await;
    api_post_ok(pve, &format!("/nodes/pve1/qemu/{vmid}/status/start"), &[]).await;
}

/// `application/x-www-form-urlencoded` text of these pairs (how PVE clients send parameters).
pub fn form_urlencode(pairs: &[(&str, &str)]) -> String {
    fn enc(s: &str) -> String {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                    char::from(b).to_string()
                }
                b' ' => "+".to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect()
    }
    pairs
        .iter()
        .map(|(k, v)| format!("{}={}", enc(k), enc(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// The rustls client configuration (ring provider) that trusts exactly the certificates in the
/// PEM file `cafile`.
pub fn rustls_config_for(cafile: &Path) -> rustls::ClientConfig {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(cafile)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", cafile.display()));
    for cert in certs {
        let cert = cert.unwrap_or_else(|e| panic!("bad PEM in {}: {e}", cafile.display()));
        roots
            .add(cert)
            .unwrap_or_else(|e| panic!("{} holds an unusable certificate: {e}", cafile.display()));
    }
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap_or_else(|e| panic!("rustls protocol versions: {e}"))
        .with_root_certificates(roots)
        .with_no_client_auth()
}

/// An async reqwest client over rustls (ring) that trusts only the certificates in `cafile`.
/// It reports the peer certificate in each response's `reqwest::tls::TlsInfo`.
pub fn https_client_for(cafile: &Path) -> reqwest::Client {
    reqwest::Client::builder()
        .tls_backend_preconfigured(rustls_config_for(cafile))
        .tls_info(true)
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap_or_else(|e| panic!("cannot build the HTTPS client: {e}"))
}

// --------------------------------------------------------------------------- .vmlist

/// One guest of `/etc/pve/.vmlist`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmlistEntry {
    /// The guest id.
    pub vmid: u32,
    /// The node whose config folder holds it.
    pub node: String,
    /// `lxc` or `qemu`.
    pub kind: String,
}

impl VmlistEntry {
    /// An entry.
    pub fn new(vmid: u32, node: &str, kind: &str) -> Self {
        VmlistEntry {
            vmid,
            node: node.to_string(),
            kind: kind.to_string(),
        }
    }
}

impl From<(u32, &str, &str)> for VmlistEntry {
    fn from((vmid, node, kind): (u32, &str, &str)) -> Self {
        VmlistEntry::new(vmid, node, kind)
    }
}

/// The `.vmlist` entries of a scenario's guests, in the scenario's order, then its
/// `vmlist_extra` entries (guests only the local list knows).
pub fn vmlist_entries_of(scenario: &Value) -> Vec<VmlistEntry> {
    let guests = scenario
        .get("guests")
        .and_then(Value::as_array)
        .into_iter()
        .flatten();
    let extra = scenario
        .get("vmlist_extra")
        .and_then(Value::as_array)
        .into_iter()
        .flatten();
    Some(guests.chain(extra).collect::<Vec<_>>())
        .map(|guests| {
            guests
                .into_iter()
                .map(|g| {
                    let vmid = g
                        .get("vmid")
                        .and_then(Value::as_u64)
                        .and_then(|v| u32::try_from(v).ok())
                        .unwrap_or_else(|| panic!("scenario guest without a valid vmid: {g}"));
                    VmlistEntry::new(
                        vmid,
                        g.get("node").and_then(Value::as_str).unwrap_or("pve1"),
                        g.get("type").and_then(Value::as_str).unwrap_or("qemu"),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The bytes pmxcfs serves as `/etc/pve/.vmlist` for these guests, in the given order (pmxcfs
/// uses hash order; pass them shuffled to test that a reader does not rely on sorting). Each
/// entry's config version is its position plus one; the global version is the count plus 3.
/// With no guests there is no `ids` key at all.
pub fn vmlist_text<E: Clone + Into<VmlistEntry>>(entries: &[E]) -> String {
    let entries: Vec<VmlistEntry> = entries.iter().cloned().map(Into::into).collect();
    let mut out = format!("{{\n\"version\": {}", entries.len() + 3);
    if !entries.is_empty() {
        out.push_str(",\n\"ids\": {\n");
        let lines: Vec<String> = entries
            .iter()
            .enumerate()
            .map(|(i, e)| {
                format!(
                    "\"{}\": {{ \"node\": \"{}\", \"type\": \"{}\", \"version\": {} }}",
                    e.vmid,
                    e.node,
                    e.kind,
                    i + 1
                )
            })
            .collect();
        out.push_str(&lines.join(",\n"));
        out.push('}');
    }
    out.push_str("\n\n}\n");
    out
}

/// Write [`vmlist_text`] to `path`.
pub fn write_vmlist<E: Clone + Into<VmlistEntry>>(path: &Path, entries: &[E]) {
    fs::write(path, vmlist_text(entries))
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}

// ------------------------------------------------------------------------ agent files

/// How `[pve]` trusts the fake's certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PveTrust {
    /// `tls_fingerprint` = the SHA-256 pin.
    #[default]
    Pin,
    /// `ca_file` = the fake's certificate.
    CaFile,
}

/// Where the agent's `.vmlist` comes from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum VmlistSource {
    /// The fake's live `.vmlist` (every guest it has, plus the scenario's `vmlist_extra`),
    /// rewritten as guests come and go.
    #[default]
    Live,
    /// The scenario's guests, written once.
    FromScenario,
    /// Exactly these entries.
    Entries(Vec<VmlistEntry>),
    /// No file at all (the path in the config does not exist).
    Missing,
}

/// `[hub]` of the agent config.
#[derive(Clone, PartialEq, Eq)]
pub struct HubOptions {
    /// `wss://…` or `ws://…`.
    pub url: String,
    /// The credential written to the hub token file (mode 0600).
    pub token: String,
    /// `tls_fingerprint`, if any.
    pub tls_fingerprint: Option<String>,
    /// `ca_file`, if any.
    pub ca_file: Option<PathBuf>,
}

impl fmt::Debug for HubOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubOptions")
            .field("url", &self.url)
            .field("tls_fingerprint", &self.tls_fingerprint)
            .field("ca_file", &self.ca_file)
            .finish_non_exhaustive()
    }
}

/// What [`AgentFiles::write`] puts into `agent.toml`. `Default` gives node `pve1`, the
/// scenario's first pool, the pin, the scenario's `.vmlist`, storage `local-lvm`, the first
/// backup volume of the scenario as `selftest_source`, and empty bootstrap/checks folders in
/// the temporary directory.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// `node`.
    pub node: String,
    /// `pool` (`None`: the scenario's first pool).
    pub pool: Option<String>,
    /// How `[pve]` trusts the certificate.
    pub trust: PveTrust,
    /// The `.vmlist` to write.
    pub vmlist: VmlistSource,
    /// `[provision] storage`.
    pub storage: String,
    /// `[provision] selftest_source` (`None`: the scenario's first backup volume, if any).
    pub selftest_source: Option<String>,
    /// Content of `datacenter.cfg` (`None`: the file is not written).
    pub datacenter_cfg: Option<String>,
    /// Content of `jobs.cfg`, the cluster's backup (and other) jobs in pmxcfs's section-config
    /// format (`None`: the file is not written, as on a cluster where no job was ever made).
    pub jobs_cfg: Option<String>,
    /// `[hub]`, if any.
    pub hub: Option<HubOptions>,
    /// Raw TOML appended at the end (e.g. another table).
    pub extra_toml: String,
    /// LXC exec through the root exec helper: `[exec] helper_socket` names
    /// [`AgentFiles::exec_socket`] and `user_cfg_path` the fake's live `user.cfg`. The helper
    /// process itself is started by [`crate::world::World`] (or the test, with
    /// [`crate::agent::ExecHelper`]). `false`: no `[exec]` table (the agent, as root, runs `pct`
    /// itself).
    pub exec_helper: bool,
}

impl Default for AgentOptions {
    fn default() -> Self {
        AgentOptions {
            node: "pve1".to_string(),
            pool: None,
            trust: PveTrust::Pin,
            vmlist: VmlistSource::Live,
            storage: "local-lvm".to_string(),
            selftest_source: None,
            datacenter_cfg: None,
            jobs_cfg: None,
            hub: None,
            extra_toml: String::new(),
            exec_helper: true,
        }
    }
}

/// An agent configuration for one [`FakePve`], in a temporary directory under [`state_base`]
/// (never `/tmp`) that lives as long as this value: `agent.toml`, `pve-token` (0600), `vmlist`, `state/`, `bootstrap.d/`,
/// `checks.d/`, and `datacenter.cfg` and `jobs.cfg` when asked for.
#[derive(Debug)]
pub struct AgentFiles {
    dir: TempDir,
    /// `agent.toml`.
    pub config_path: PathBuf,
    /// `state_dir`.
    pub state_dir: PathBuf,
    /// `vmlist_path`.
    pub vmlist_path: PathBuf,
    /// `[pve] token_secret_file`.
    pub token_secret_file: PathBuf,
    /// `datacenter_cfg`.
    pub datacenter_cfg: PathBuf,
    /// `jobs_cfg`: the agent's `jobs.cfg` (0640, root's, as pmxcfs serves it), written when
    /// [`AgentOptions::jobs_cfg`] asks; the exec helper reads it from here.
    pub jobs_cfg: PathBuf,
    /// `[provision] bootstrap_dir`.
    pub bootstrap_dir: PathBuf,
    /// `[provision] checks_dir`.
    pub checks_dir: PathBuf,
    /// `[metrics] dir` (0755, created empty).
    pub metrics_dir: PathBuf,
    /// `[exec] helper_socket`, when the agent execs into containers through the helper.
    pub exec_socket: Option<PathBuf>,
    /// `user_cfg_path`: the fake's live `user.cfg`.
    pub user_cfg_path: PathBuf,
    /// `[exec] pve_nodes_dir`: the fake's live `nodes` folder.
    pub pve_nodes_dir: PathBuf,
}

/// A TOML basic string.
pub fn toml_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn toml_path(p: &Path) -> String {
    toml_string(&p.to_string_lossy())
}

/// The first backup volume of a scenario as a volid (`storage:volname`).
pub fn first_backup_volid(scenario: &Value) -> Option<String> {
    let volumes = scenario.get("volumes")?.as_object()?;
    volumes.iter().find_map(|(sid, vols)| {
        vols.as_array()?.iter().find_map(|v| {
            let content = v.get("content").and_then(Value::as_str).unwrap_or("backup");
            (content == "backup")
                .then(|| v.get("volname").and_then(Value::as_str))
                .flatten()
                .map(|name| format!("{sid}:{name}"))
        })
    })
}

impl AgentFiles {
    /// Write the agent's files for `pve` with the default options.
    pub fn for_fake(pve: &FakePve) -> AgentFiles {
        AgentFiles::write(pve, &AgentOptions::default())
    }

    /// Write the agent's files for `pve`.
    pub fn write(pve: &FakePve, opts: &AgentOptions) -> AgentFiles {
        // The agent may switch to its user (`[agent] user`), which must reach its state dir,
        // the helper's socket and what it reads after the switch.
        let dir = crate::reach::reachable_tempdir("felhom-agent-", &state_base());
        let p = |name: &str| dir.path().join(name);
        let files = AgentFiles {
            config_path: p("agent.toml"),
            state_dir: p("state"),
            vmlist_path: match opts.vmlist {
                VmlistSource::Live => pve.vmlist_path(),
                _ => p("vmlist"),
            },
            token_secret_file: p("pve-token"),
            // The cluster's own file when the scenario has one (its tag policy is the one the
            // fake enforces), else the agent's copy, written when `opts` asks.
            datacenter_cfg: if pve
                .scenario
                .get("datacenter_cfg")
                .is_some_and(Value::is_object)
                && opts.datacenter_cfg.is_none()
            {
                pve.datacenter_cfg_path()
            } else {
                p("datacenter.cfg")
            },
            jobs_cfg: p("jobs.cfg"),
            bootstrap_dir: p("bootstrap.d"),
            checks_dir: p("checks.d"),
            metrics_dir: p("metrics"),
            exec_socket: opts.exec_helper.then(|| p("exec.sock")),
            user_cfg_path: pve.user_cfg_path(),
            pve_nodes_dir: pve.nodes_dir(),
            dir,
        };
        if let Some(socket) = &files.exec_socket {
            // sun_path holds 108 bytes with its NUL.
            assert!(
                socket.as_os_str().len() < 108,
                "the exec helper socket {} is too long for a Unix socket; set {STATE_BASE_ENV} to a shorter folder",
                socket.display()
            );
        }
        // The agent refuses folders and files it reads that group or others may change
        // (whatever the umask of the test run).
        for (d, mode) in [
            (&files.state_dir, 0o700),
            (&files.bootstrap_dir, 0o755),
            (&files.checks_dir, 0o755),
            (&files.metrics_dir, 0o755),
        ] {
            fs::create_dir_all(d).unwrap_or_else(|e| panic!("cannot create {}: {e}", d.display()));
            fs::set_permissions(d, fs::Permissions::from_mode(mode))
                .unwrap_or_else(|e| panic!("cannot chmod {}: {e}", d.display()));
        }
        // What the package installs: the default bootstrap profile and check pack (`doctor`
        // and every provision's preflight load them).
        crate::world::install_default_profile_and_checks(&files);
        write_private(
            &files.token_secret_file,
            format!("{}\n", pve.token_secret()).as_bytes(),
        );
        match &opts.vmlist {
            VmlistSource::Live => {}
            VmlistSource::FromScenario => write_vmlist(&files.vmlist_path, &pve.vmlist_entries()),
            VmlistSource::Entries(e) => write_vmlist(&files.vmlist_path, e),
            VmlistSource::Missing => {}
        }
        if let Some(text) = &opts.datacenter_cfg {
            fs::write(&files.datacenter_cfg, text)
                .unwrap_or_else(|e| panic!("cannot write {}: {e}", files.datacenter_cfg.display()));
        }
        if let Some(text) = &opts.jobs_cfg {
            files.write_jobs_cfg(text);
        }
        let pool = opts.pool.clone().unwrap_or_else(|| pve.pool());
        let trust = match opts.trust {
            PveTrust::Pin => format!("tls_fingerprint = {}", toml_string(pve.sha256_hex())),
            PveTrust::CaFile => format!("ca_file = {}", toml_path(pve.cafile())),
        };
        let mut text = format!(
            "node = {}\npool = {}\nstate_dir = {}\nvmlist_path = {}\ndatacenter_cfg = {}\n\
             jobs_cfg = {}\n{}\n\
             [pve]\nurl = {}\ntoken_id = {}\ntoken_secret_file = {}\n{trust}\n\n\
             [metrics]\ndir = {}\n\n{}\
             [provision]\nstorage = {}\nbootstrap_dir = {}\nchecks_dir = {}\n",
            toml_string(&opts.node),
            toml_string(&pool),
            toml_path(&files.state_dir),
            toml_path(&files.vmlist_path),
            toml_path(&files.datacenter_cfg),
            toml_path(&files.jobs_cfg),
            if files.exec_socket.is_some() {
                format!("user_cfg_path = {}\n", toml_path(&files.user_cfg_path))
            } else {
                String::new()
            },
            toml_string(pve.url()),
            toml_string(&pve.token_id()),
            toml_path(&files.token_secret_file),
            toml_path(&files.metrics_dir),
            // Before [provision], which a test's extra TOML may extend.
            // The bed's lxcpath, where its running containers' LXC monitor stand-ins hold their
            // command sockets (checked before every `pct exec`, the helper's or the agent's).
            match (&files.exec_socket, pve.bed_lxc_path()) {
                (Some(socket), lxc) => format!(
                    "[exec]\nhelper_socket = {}\npve_nodes_dir = {}\n{}\n",
                    toml_path(socket),
                    toml_path(&files.pve_nodes_dir),
                    lxc.map(|p| format!("lxc_path = {}\n", toml_path(&p)))
                        .unwrap_or_default()
                ),
                (None, Some(lxc)) => format!(
                    "[exec]\npve_nodes_dir = {}\nlxc_path = {}\n\n",
                    toml_path(&files.pve_nodes_dir),
                    toml_path(&lxc)
                ),
                (None, None) => String::new(),
            },
            toml_string(&opts.storage),
            toml_path(&files.bootstrap_dir),
            toml_path(&files.checks_dir),
        );
        if let Some(source) = opts
            .selftest_source
            .clone()
            .or_else(|| first_backup_volid(pve.scenario()))
        {
            text.push_str(&format!("selftest_source = {}\n", toml_string(&source)));
        }
        if let Some(hub) = &opts.hub {
            let token_file = files.dir.path().join("hub-token");
            write_private(&token_file, format!("{}\n", hub.token).as_bytes());
            text.push_str(&format!(
                "\n[hub]\nurl = {}\ntoken_file = {}\n",
                toml_string(&hub.url),
                toml_path(&token_file)
            ));
            if let Some(fp) = &hub.tls_fingerprint {
                text.push_str(&format!("tls_fingerprint = {}\n", toml_string(fp)));
            }
            if let Some(ca) = &hub.ca_file {
                text.push_str(&format!("ca_file = {}\n", toml_path(ca)));
            }
        }
        if !opts.extra_toml.is_empty() {
            text.push('\n');
            text.push_str(&opts.extra_toml);
            text.push('\n');
        }
        fs::write(&files.config_path, text)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", files.config_path.display()));
        fs::set_permissions(&files.config_path, fs::Permissions::from_mode(0o644))
            .unwrap_or_else(|e| panic!("cannot chmod {}: {e}", files.config_path.display()));
        files
    }

    /// The temporary directory holding everything.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The text of `agent.toml`.
    pub fn config_text(&self) -> String {
        fs::read_to_string(&self.config_path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", self.config_path.display()))
    }

    /// Write (or replace) `jobs.cfg` with `text`: a regular file of root's, mode 0640, as
    /// pmxcfs serves `/etc/pve/jobs.cfg` (root:www-data).
    pub fn write_jobs_cfg(&self, text: &str) {
        fs::write(&self.jobs_cfg, text)
            .and_then(|()| fs::set_permissions(&self.jobs_cfg, fs::Permissions::from_mode(0o640)))
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", self.jobs_cfg.display()));
    }

    /// Replace the `.vmlist` (e.g. after the fake gained or lost a guest).
    pub fn write_vmlist<E: Clone + Into<VmlistEntry>>(&self, entries: &[E]) {
        write_vmlist(&self.vmlist_path, entries);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts_are_distinct_and_never_in_127_0() {
        let mut seen = std::collections::HashSet::new();
        for pid in [1u32, 2, 999, 4_194_303, 15_999, 16_000] {
            for i in 0..40 {
                let h = loopback_host(pid, i);
                assert!(!h.starts_with("127.0."), "{h}");
                let octets: Vec<u32> = h.split('.').map(|o| o.parse().expect("octet")).collect();
                assert_eq!(octets.len(), 4);
                assert!(octets[1] >= 1 && octets[1] <= 255, "{h}");
                assert!(
                    octets[2] <= 255 && octets[3] >= 1 && octets[3] <= 254,
                    "{h}"
                );
                if pid != 16_000 {
                    assert!(seen.insert(h.clone()), "{h} twice");
                }
            }
        }
    }

    #[test]
    fn vmlist_text_matches_pmxcfs_bytes() {
        assert_eq!(
            vmlist_text(&[(100u32, "pve1", "qemu"), (101, "pve2", "lxc")]),
            "{\n\"version\": 5,\n\"ids\": {\n\
             \"100\": { \"node\": \"pve1\", \"type\": \"qemu\", \"version\": 1 },\n\
             \"101\": { \"node\": \"pve2\", \"type\": \"lxc\", \"version\": 2 }}\n\n}\n"
        );
        assert_eq!(
            vmlist_text::<VmlistEntry>(&[]),
            "{\n\"version\": 3\n\n}\n",
            "no ids key without guests"
        );
    }

    #[test]
    fn recorded_request_targets_vmid_and_params() {
        let r = RecordedRequest {
            method: "DELETE".into(),
            path: "/api2/json/nodes/pve1/lxc/201".into(),
            query: "purge=1&force=1".into(),
            body: String::new(),
        };
        assert!(r.targets_vmid(201));
        assert!(!r.targets_vmid(20));
        assert!(!r.targets_vmid(2011));
        assert_eq!(r.param("purge"), Some("1"));
        assert_eq!(r.param("destroy"), None);
        let list = RecordedRequest {
            method: "GET".into(),
            path: "/api2/json/nodes/pve1/lxc".into(),
            query: String::new(),
            body: String::new(),
        };
        assert!(!list.targets_vmid(201));
        assert!(!list.is_write());
    }

    #[test]
    fn toml_strings_are_escaped() {
        assert_eq!(toml_string("a\"b\\c\n"), "\"a\\\"b\\\\c\\n\"");
    }

    #[test]
    fn demo_backup_volid() {
        assert_eq!(
            first_backup_volid(&demo_scenario()).as_deref(),
            Some("local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst")
        );
    }

    #[test]
    fn form_encoding() {
        assert_eq!(
            form_urlencode(&[("ostemplate", "local:backup/a b.tar"), ("vmid", "201")]),
            "ostemplate=local%3Abackup%2Fa+b.tar&vmid=201"
        );
    }

    #[test]
    fn dechunk_joins_chunks() {
        assert_eq!(dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"), b"abcde");
    }
}
