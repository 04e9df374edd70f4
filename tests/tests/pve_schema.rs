//! Every request the end-to-end suite sends is checked against PVE's API schema by the bed
//! (tests/fakepve/scenario.py `_check_schema`): a request the schema rejects is recorded, and
//! dropping the fake fails the test that sent it. Shown here once on purpose.

use felhom_agent::config::Config;
use felhom_agent::pve::request::ApiRequest;
use felhom_agent::pve::PveClient;
use felhom_tests::fakepve::{AgentFiles, FakePve};

#[tokio::test]
async fn an_unknown_parameter_is_a_schema_violation() {
    let pve = FakePve::demo();
    let files = AgentFiles::for_fake(&pve);
    let cfg = Config::load(&files.config_path).expect("config");
    let client = PveClient::new(&cfg.pve).expect("client");

    // What the agent sends is accepted.
    client.version().await.expect("version");
    client.pool("felhom").await.expect("pool");
    assert_eq!(pve.schema_violations(), Vec::<String>::new());

    // An unknown parameter, a value of the wrong type, an unknown path.
    let _ = client
        .call(&ApiRequest::get(&["cluster", "resources"]).param("kind", "vm"))
        .await;
    let _ = client
        .call(
            &ApiRequest::get(&["nodes", "pve1", "tasks"])
                .param("limit", "many")
                .param("source", "all"),
        )
        .await;
    let _ = client
        .call(&ApiRequest::get(&["nodes", "pve1", "nothing-here"]))
        .await;
    let seen = pve.take_schema_violations();
    assert_eq!(seen.len(), 3, "{seen:#?}");
    assert!(
        seen[0].contains("GET /api2/json/cluster/resources") && seen[0].contains("kind:"),
        "{seen:#?}"
    );
    assert!(seen[1].contains("limit:"), "{seen:#?}");
    assert!(seen[2].contains("no such path"), "{seen:#?}");
    // A value never appears, only the parameter's name and PVE's reason.
    assert!(seen.iter().all(|v| !v.contains("many")), "{seen:#?}");
}

#[test]
#[should_panic(expected = "requests PVE's API schema rejects")]
fn the_fake_fails_the_test_that_sent_a_request_the_schema_rejects() {
    let pve = FakePve::demo();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let files = AgentFiles::for_fake(&pve);
        let cfg = Config::load(&files.config_path).expect("config");
        let client = PveClient::new(&cfg.pve).expect("client");
        let _ = client
            .call(&ApiRequest::get(&["version"]).param("verbose", "1"))
            .await;
    });
    drop(pve);
}
