//! The application group the real-container tests and the group benchmark prove: a database
//! guest (200, busybox httpd on its stored address) and a shop guest (201, whose order page is
//! a CGI that asks the database over the network and answers 502 when it cannot), each an
//! unprivileged Debian 12 container with one static NIC on `vmbr0` in one /24.
//!
//! [`Shop`] names the two stored addresses, so that two groups of the same shape on other
//! addresses of the same subnet can run side by side (each in a lab of its own).

use serde_json::{json, Value};

/// Where a shop and its database live: the last octet of each one's stored address in
/// 10.20.0.0/24 (also the last byte of each one's stored MAC).
#[derive(Debug, Clone, Copy)]
pub struct Shop {
    /// The database's last octet.
    pub db: u8,
    /// The shop's last octet.
    pub shop: u8,
}

/// The pair the group tests use first: the database on 10.20.0.30, the shop on 10.20.0.31.
pub const SHOP: Shop = Shop { db: 30, shop: 31 };

/// A database that fails for its own reason (a broken backup).
pub const BROKEN_DB_UNIT: &str = "[Unit]\nDescription=The database\nWants=network-online.target\nAfter=network-online.target\n\n[Service]\nType=oneshot\nExecStart=/bin/false\n";

/// The operator's check of the database: its unit is active.
pub const DATABASE_CHECK: &str = r#"
[[check]]
name = "database-serves"
sql = "SELECT id FROM systemd_units WHERE id = 'db.service' AND active_state = 'active'"
expect = "rows == 1"
guests = [200]
"#;

impl Shop {
    /// The database's stored address.
    pub fn db_ip(&self) -> String {
        format!("10.20.0.{}", self.db)
    }

    /// The shop's stored address.
    pub fn shop_ip(&self) -> String {
        format!("10.20.0.{}", self.shop)
    }

    /// The database: busybox's httpd bound to its stored address, after the network is
    /// online.
    pub fn db_unit(&self) -> String {
        format!(
            "[Unit]\nDescription=The database\nWants=network-online.target\nAfter=network-online.target\n\n[Service]\nExecStart=/bin/busybox httpd -f -p {}:80 -h /srv/db\n",
            self.db_ip()
        )
    }

    /// The shop: busybox's httpd on its stored address, with the order page a CGI (made
    /// executable first: the bed writes a backup's files 0644).
    pub fn shop_unit(&self) -> String {
        format!(
            "[Unit]\nDescription=The shop\nWants=network-online.target\nAfter=network-online.target\n\n[Service]\nExecStartPre=/bin/chmod 0755 /srv/www/cgi-bin/order\nExecStart=/bin/busybox httpd -f -p {}:80 -h /srv/www\n",
            self.shop_ip()
        )
    }

    /// The order page: 200 with the stock when the database answers, else 502 (bounded by
    /// `timeout`: Debian 12's busybox wget crashes on its own `-T`).
    pub fn order_cgi(&self) -> String {
        format!(
            "#!/bin/sh\nif stock=$(timeout 5 /bin/busybox wget -q -O - http://{}/stock 2>/dev/null); then\n  printf 'Content-Type: text/plain\\r\\n\\r\\n%s\\n' \"$stock\"\nelse\n  printf 'Status: 502 Bad Gateway\\r\\nContent-Type: text/plain\\r\\n\\r\\nno database\\n'\nfi\n",
            self.db_ip()
        )
    }

    /// The operator's check of the shop (its order page answers 200) and of the database
    /// (its unit is active).
    pub fn pack(&self) -> String {
        format!("{}{DATABASE_CHECK}", self.order_page_check())
    }

    /// The shop's order-page check alone.
    pub fn order_page_check(&self) -> String {
        format!(
            r#"
[[check]]
name = "order-page"
sql = "SELECT response_code FROM curl WHERE url = 'http://{}/cgi-bin/order'"
expect = "response_code == '200'"
guests = [201]
"#,
            self.shop_ip()
        )
    }

    /// The pool with the database (200, its unit `db_unit`) and the shop (201), each with one
    /// backup on `local`; `shop_files` and `db_files` add files to each one's root.
    pub fn scenario(&self, db_unit: &str, db_files: Value, shop_files: Value) -> Value {
        self.scenario_with_shop_at(db_unit, db_files, shop_files, &self.shop_ip())
    }

    /// [`Shop::scenario`] with the shop stored at `shop_ip` (/24) instead of its own address
    /// (its web server still binds its own: a shop on another subnet).
    pub fn scenario_with_shop_at(
        &self,
        db_unit: &str,
        db_files: Value,
        shop_files: Value,
        shop_ip: &str,
    ) -> Value {
        let mut s = crate::verdict::debian_backup(None, &[], json!({}), json!({}));
        let mut db_root = json!({
            "/etc/systemd/system/db.service": db_unit,
            "/etc/systemd/system/multi-user.target.d/app.conf": "[Unit]\nWants=db.service\n",
            "/srv/db/stock": "42 tins\n",
        });
        merge(&mut db_root, db_files);
        let (db_config, db_guest) = member("db", &self.db_ip(), self.db, db_root);
        let vol = &mut s["volumes"]["local"][0];
        vol["config"] = db_config;
        vol["guest"] = db_guest;
        let mut shop_root = json!({
            "/etc/systemd/system/shop.service": self.shop_unit(),
            "/etc/systemd/system/multi-user.target.d/app.conf": "[Unit]\nWants=shop.service\n",
            "/srv/www/cgi-bin/order": self.order_cgi(),
        });
        merge(&mut shop_root, shop_files);
        let (shop_config, shop_guest) = member("shop", shop_ip, self.shop, shop_root);
        s["volumes"]["local"]
            .as_array_mut()
            .unwrap_or_else(|| panic!("no volumes"))
            .push(json!({
                "volname": "backup/vzdump-lxc-201-2026_01_01-00_00_00.tar.zst",
                "vmid": 201,
                "size": 123456789,
                "config": shop_config,
                "guest": shop_guest,
            }));
        let guests = s["guests"]
            .as_array_mut()
            .unwrap_or_else(|| panic!("no guests"));
        for g in guests.iter_mut().filter(|g| g["vmid"] == 200) {
            g["name"] = json!("db");
        }
        guests.push(
            json!({"vmid": 201, "type": "lxc", "name": "shop", "node": "pve1",
                "status": "running", "pool": "felhom"}),
        );
        s
    }
}

/// Add `more`'s keys to `root` (both objects).
fn merge(root: &mut Value, more: Value) {
    if let (Some(root), Value::Object(more)) = (root.as_object_mut(), more) {
        root.extend(more);
    }
}

/// A guest's stored config and root (Debian 12, one static NIC on vmbr0).
fn member(hostname: &str, ip: &str, last: u8, files: Value) -> (Value, Value) {
    let config = json!({
        "arch": "amd64",
        "ostype": "debian",
        "hostname": hostname,
        "memory": "256",
        "rootfs": "local-lvm:vm-200-disk-0,size=8G",
        "unprivileged": "1",
        "net0": format!("name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:02:{last:02},ip={ip}/24,type=veth"),
    });
    (config, json!({ "files": files, "links": {} }))
}

/// Append `[[restore_test.group]]` `name` with `guests` and `boot_delay` to the agent's
/// config at `config_path`.
pub fn add_group(config_path: &std::path::Path, name: &str, guests: &[u32], boot_delay: u64) {
    let mut cfg = std::fs::read_to_string(config_path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", config_path.display()));
    let guests: Vec<String> = guests.iter().map(u32::to_string).collect();
    cfg.push_str(&format!(
        "\n[[restore_test.group]]\nname = \"{name}\"\nguests = [{}]\nboot_delay = {boot_delay}\n",
        guests.join(", ")
    ));
    std::fs::write(config_path, cfg)
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", config_path.display()));
}

/// The copy of `guest` among a run's copies (`--json`'s `copies`).
pub fn copy_of(copies: &[Value], guest: u32) -> &Value {
    copies
        .iter()
        .find(|c| c["guest"] == guest)
        .unwrap_or_else(|| panic!("no copy of guest {guest}: {copies:#?}"))
}

/// `--selftest=restore --guest <guest> --json` in `w` to its end: exit code, the copies'
/// documents, and all it said (stdout, stderr).
pub fn prove(w: &crate::world::World, guest: u32) -> (Option<i32>, Vec<Value>, String) {
    prove_with(w.command(), guest)
}

/// [`prove`] with the agent command `cmd` (its environment set by the caller).
pub fn prove_with(mut cmd: std::process::Command, guest: u32) -> (Option<i32>, Vec<Value>, String) {
    let run: crate::agent::AgentRun = cmd
        .args([
            "--selftest=restore",
            "--guest",
            &guest.to_string(),
            "--json",
        ])
        .output()
        .unwrap_or_else(|e| panic!("cannot run the agent: {e}"))
        .into();
    let doc: Value = serde_json::from_str(&run.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", run.stdout, run.stderr));
    let copies = doc["copies"].as_array().cloned().unwrap_or_default();
    (run.code, copies, format!("{}\n{}", run.stdout, run.stderr))
}
