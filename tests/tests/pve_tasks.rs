//! The bed's task endpoints as pve-manager `PVE/API2/Tasks.pm` serves them (`node_tasks`:
//! `source`, `since`, `until`, `typefilter`, `userfilter`, `total`; `read_task_log`: `total`
//! beside the lines), and the agent reading the last lines of a task log.

use felhom_agent::config::Config;
use felhom_agent::pve::task::log_tail;
use felhom_agent::pve::PveClient;
use felhom_tests::fakepve::{api_get as get, api_send as send, AgentFiles, FakePve};
use serde_json::{json, Value};

const LXC_BACKUP: &str = "local:backup/vzdump-lxc-200-2026_01_01-00_00_00.tar.zst";

fn upids(body: &Value) -> Vec<String> {
    body["data"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|t| t["upid"].as_str().unwrap_or("").to_string())
        .collect()
}

#[tokio::test]
async fn the_task_list_honours_source_since_typefilter_and_userfilter() {
    let pve = FakePve::demo();
    // A finished task (time_scale 0: it ends before the answer).
    let (status, body) = send(
        &pve,
        reqwest::Method::POST,
        "/nodes/pve1/lxc/200/status/stop",
        &[],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let stop = body["data"].as_str().expect("UPID").to_string();
    // A running one: a restore that takes 100 s.
    pve.set(json!({"time_scale": 1.0, "ct_secs": {"create": 100}}));
    let (status, body) = send(
        &pve,
        reqwest::Method::POST,
        "/nodes/pve1/lxc",
        &[
            ("vmid", "150"),
            ("ostemplate", LXC_BACKUP),
            ("restore", "1"),
            ("storage", "local-lvm"),
            ("pool", "felhom"),
            ("unprivileged", "1"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let restore = body["data"].as_str().expect("UPID").to_string();
    let tasks = |query: &'static str| {
        let pve = &pve;
        async move {
            let (status, body) = get(pve, &format!("/nodes/pve1/tasks{query}")).await;
            assert_eq!(status, 200, "{query}: {body}");
            body
        }
    };

    // `archive`, the default: finished tasks only.
    let body = tasks("").await;
    assert!(
        upids(&body).contains(&stop) && !upids(&body).contains(&restore),
        "{body}"
    );
    assert_eq!(body["total"], json!(upids(&body).len()), "{body}");
    let body = tasks("?source=active").await;
    assert_eq!(upids(&body), vec![restore.clone()], "{body}");
    assert_eq!(body["data"][0]["status"], "RUNNING");
    let body = tasks("?source=all").await;
    assert_eq!(upids(&body)[0], restore, "running first: {body}");
    assert!(upids(&body).contains(&stop), "{body}");
    // PVE lists a token's task under its user, the token beside it.
    assert_eq!(body["data"][0]["user"], "felhom@pve", "{body}");
    assert_eq!(body["data"][0]["tokenid"], "agent", "{body}");

    let body = tasks("?source=all&typefilter=vzrestore").await;
    assert_eq!(upids(&body), vec![restore.clone()], "{body}");
    let body = tasks("?source=all&typefilter=vzres").await;
    assert!(upids(&body).is_empty(), "typefilter is exact: {body}");
    let body = tasks("?source=all&userfilter=FELHOM").await;
    assert_eq!(
        upids(&body).len(),
        2,
        "a case-insensitive substring: {body}"
    );
    let body = tasks("?source=all&userfilter=root").await;
    assert!(upids(&body).is_empty(), "{body}");

    let started = body_start(&pve, &restore);
    let body = get(
        &pve,
        &format!("/nodes/pve1/tasks?source=all&since={started}&vmid=150"),
    )
    .await
    .1;
    assert_eq!(upids(&body), vec![restore.clone()], "{body}");
    let body = get(
        &pve,
        &format!(
            "/nodes/pve1/tasks?source=all&since={}&vmid=150",
            started + 1
        ),
    )
    .await
    .1;
    assert!(upids(&body).is_empty(), "{body}");
    let body = tasks("?source=all&limit=1").await;
    assert_eq!(upids(&body).len(), 1);
    assert_eq!(
        body["total"],
        json!(2),
        "total counts every matching task: {body}"
    );
    let body = tasks("?source=all&start=1&limit=1").await;
    assert_eq!(upids(&body), vec![stop.clone()], "{body}");
    let (_, body) = get(&pve, "/nodes/pve1/tasks?source=all&errors=1").await;
    assert_eq!(
        upids(&body),
        vec![restore],
        "errors=1 keeps running ones (unknown): {body}"
    );
}

fn body_start(pve: &FakePve, upid: &str) -> u64 {
    pve.tasks()
        .iter()
        .find(|t| t["upid"] == upid)
        .and_then(|t| t["starttime"].as_u64())
        .expect("the task's start time")
}

#[tokio::test]
async fn the_task_log_carries_total_and_the_agent_reads_its_last_lines() {
    let pve = FakePve::demo();
    let (status, body) = send(
        &pve,
        reqwest::Method::POST,
        "/nodes/pve1/lxc",
        &[
            ("vmid", "151"),
            ("ostemplate", LXC_BACKUP),
            ("restore", "1"),
            ("storage", "local-lvm"),
            ("pool", "felhom"),
            ("unprivileged", "1"),
        ],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let upid = body["data"].as_str().expect("UPID").to_string();
    let log: Vec<String> = pve
        .tasks()
        .iter()
        .find(|t| t["upid"] == upid.as_str())
        .and_then(|t| t["log"].as_array().cloned())
        .expect("the task's log")
        .iter()
        .map(|l| l.as_str().unwrap_or("").to_string())
        .collect();
    assert!(log.len() >= 3, "{log:?}");
    let (status, body) = get(
        &pve,
        &format!("/nodes/pve1/tasks/{upid}/log?start=0&limit=1"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["total"], json!(log.len()), "{body}");
    assert_eq!(body["data"].as_array().map(Vec::len), Some(1));
    let (_, body) = get(
        &pve,
        &format!("/nodes/pve1/tasks/{upid}/log?start=1&limit=0"),
    )
    .await;
    assert_eq!(
        body["data"].as_array().map(Vec::len),
        Some(log.len() - 1),
        "limit 0: to the end"
    );

    let files = AgentFiles::for_fake(&pve);
    let cfg = Config::load(&files.config_path).expect("config");
    let client = PveClient::new(&cfg.pve).expect("client");
    let parsed = upid.parse().expect("a UPID");
    let tail = log_tail(&client, &parsed, 2).await;
    assert_eq!(tail, log[log.len() - 2..].to_vec());
    let all = log_tail(&client, &parsed, 1000).await;
    assert_eq!(all, log);
}
