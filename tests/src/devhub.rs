//! The development hub: a real websocket server on loopback that speaks the hub side of the
//! protocol well enough to test the agent and to run the demo.
//!
//! It checks the `Authorization: Bearer <token>` header of the upgrade request (a wrong or
//! missing token gets HTTP 401), answers the hello with a welcome (the highest version it shares
//! with the agent among [`DevHubOptions::versions`], heartbeat interval from
//! [`DevHubOptions`]), refuses frames in another version than the session's with
//! `unsupported_version`, records every frame it receives, acknowledges
//! every message that needs it, and applies each message id once: a message seen again is
//! counted as a duplicate and acknowledged again, but not applied again. It can send
//! dispatches (kept and re-sent after every reconnect until the agent acknowledges them, like a
//! real hub) and raw text frames (to test the agent's handling of bad frames), and it can be
//! stopped (every connection dropped at once, no close frame, the port closed) and started
//! again on the same port. What it recorded survives restarts.
//!
//! Plain `ws://` by default; with [`DevHubOptions::tls`] it serves `wss://` with a self-signed
//! certificate made at start ([`DevHub::cert_pem`], [`DevHub::fingerprint`]).
//!
//! The API is synchronous (the hub runs on its own runtime threads) so plain `#[test]`s can use
//! it beside the agent binary. It never prints the token.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use hub_protocol::{
    decode, encode, negotiate, Ack, AgentEnvelope, AgentMessage, Coverage, Dispatch,
    DispatchAction, Envelope, Event, Hello, HubMessage, Inventory, Message as _, MessageId,
    ProtocolError, ProtocolErrorCode, TxnId, TxnResult, Welcome, HANDSHAKE_VERSION,
    SUPPORTED_VERSIONS,
};
use sha2::{Digest, Sha256};
use tempfile::TempDir;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
use tokio_tungstenite::tungstenite::http::StatusCode;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use ulid::Ulid;

/// The path the hub serves (any path is accepted; this is what [`DevHub::url`] names).
pub const HUB_PATH: &str = "/agent";
/// The largest websocket message the dev hub reads.
pub const MAX_WS_MESSAGE: usize = 16 * 1024 * 1024;
/// How long [`DevHub::stop`] waits for connections to drop.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// How to run the dev hub.
#[derive(Clone)]
pub struct DevHubOptions {
    /// The loopback address to listen on (`127.0.0.1`, `127.x.y.z`).
    pub host: String,
    /// The port; 0 picks a free one (kept across restarts).
    pub port: u16,
    /// The bearer token the agent must present.
    pub token: String,
    /// The heartbeat interval the welcome sets.
    pub heartbeat_interval_secs: u32,
    /// Serve `wss://` with a self-signed certificate.
    pub tls: bool,
    /// Acknowledge what the agent sends (off: nothing is acked, so the agent keeps re-sending
    /// after reconnects).
    pub ack: bool,
    /// The session name the welcome carries (default `devhub-<n>`): a hostile hub's text.
    pub session_name: Option<String>,
    /// The protocol versions the hub speaks (default: every version of `hub-protocol`); `[1]`
    /// plays a hub of before version 2.
    pub versions: Vec<u32>,
}

impl std::fmt::Debug for DevHubOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevHubOptions")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("heartbeat_interval_secs", &self.heartbeat_interval_secs)
            .field("tls", &self.tls)
            .field("ack", &self.ack)
            .field("versions", &self.versions)
            .finish_non_exhaustive()
    }
}

impl Default for DevHubOptions {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".to_string(),
            port: 0,
            token: "devhub-test-token-3f6b1c2e".to_string(),
            heartbeat_interval_secs: 1,
            tls: false,
            ack: true,
            session_name: None,
            versions: SUPPORTED_VERSIONS.to_vec(),
        }
    }
}

/// One frame the hub received.
#[derive(Debug, Clone)]
pub struct ReceivedFrame {
    /// The session it came in (1 for the first welcomed session; 0 before a welcome).
    pub session: u64,
    /// The text as received.
    pub text: String,
    /// Its message type, when it decoded.
    pub type_name: Option<&'static str>,
    /// Its message id, when it decoded.
    pub id: Option<MessageId>,
    /// The id had been applied before.
    pub duplicate: bool,
}

/// A dispatch the hub sent.
#[derive(Debug, Clone)]
pub struct SentDispatch {
    /// Its message id.
    pub id: MessageId,
    /// The dispatch.
    pub dispatch: Dispatch,
    /// The agent acknowledged it.
    pub acked: bool,
    /// How many times it was sent.
    pub sends: u32,
}

/// Everything the hub recorded. Survives restarts.
#[derive(Debug, Clone, Default)]
pub struct HubState {
    /// Every frame received, in order.
    pub frames: Vec<ReceivedFrame>,
    /// Message ids applied.
    pub seen: HashSet<MessageId>,
    /// Frames whose id had already been applied.
    pub duplicates: u64,
    /// Applied results, by transaction (more than one means a transaction was reported twice
    /// under different message ids).
    pub results: BTreeMap<TxnId, Vec<(MessageId, TxnResult)>>,
    /// Applied inventories, in order.
    pub inventories: Vec<(MessageId, Inventory)>,
    /// Applied events, in order.
    pub events: Vec<(MessageId, Event)>,
    /// Applied coverage tables (protocol version 2), in order.
    pub coverages: Vec<(MessageId, Coverage)>,
    /// The protocol version of each welcomed session, in order.
    pub session_versions: Vec<u32>,
    /// Protocol errors the agent sent.
    pub protocol_errors: Vec<ProtocolError>,
    /// Frames from the agent that the hub could not decode.
    pub undecodable: Vec<ProtocolError>,
    /// Hellos received.
    pub hellos: Vec<Hello>,
    /// Heartbeats received.
    pub heartbeats: u64,
    /// Dispatches sent, in order.
    pub dispatches: Vec<SentDispatch>,
    /// Sessions welcomed.
    pub sessions: u64,
    /// Open connections now.
    pub connected: usize,
    /// Listening sockets open now (0 or 1).
    pub listeners: usize,
    /// Upgrade requests refused for a wrong or missing token, with when.
    pub refused: Vec<Instant>,
    /// SHA-256 of every `Authorization` header refused (to check what the agent sent without
    /// keeping a credential in memory that a `Debug` print could show).
    refused_headers: Vec<String>,
}

impl HubState {
    /// Applied results per transaction.
    pub fn results_per_txn(&self) -> BTreeMap<TxnId, usize> {
        self.results.iter().map(|(t, r)| (*t, r.len())).collect()
    }

    /// Inventories answering `inventory_request` `txn`.
    pub fn inventory_replies(&self, txn: TxnId) -> usize {
        self.inventories
            .iter()
            .filter(|(_, inv)| inv.request == Some(txn))
            .count()
    }

    /// Whether any refused upgrade carried exactly this header value.
    pub fn refused_header_was(&self, value: &str) -> bool {
        let digest = hex::encode(Sha256::digest(value.as_bytes()));
        self.refused_headers.contains(&digest)
    }
}

struct Shared {
    opts: DevHubOptions,
    state: Mutex<HubState>,
    /// Senders to the connections open now: (session, its protocol version, sender).
    outgoing: Mutex<Vec<(u64, u32, mpsc::UnboundedSender<Message>)>>,
    /// Acknowledge what the agent sends.
    ack: std::sync::atomic::AtomicBool,
    /// Disregard the agent's acks of dispatches (they stay unacked and are sent again).
    ignore_dispatch_acks: std::sync::atomic::AtomicBool,
    generation: watch::Sender<u64>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, HubState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

struct Tls {
    acceptor: tokio_rustls::TlsAcceptor,
    cert_pem: PathBuf,
    fingerprint: String,
    _dir: TempDir,
}

/// A running development hub. Dropping it stops it.
pub struct DevHub {
    rt: tokio::runtime::Runtime,
    shared: Arc<Shared>,
    addr: SocketAddr,
    tls: Option<Arc<Tls>>,
    running: bool,
}

impl std::fmt::Debug for DevHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevHub")
            .field("url", &self.url())
            .field("running", &self.running)
            .finish_non_exhaustive()
    }
}

fn hub_envelope(v: u32, message: HubMessage) -> Envelope<HubMessage> {
    let ts = felhom_agent::hub::outbox::now_timestamp()
        .unwrap_or_else(|e| panic!("the clock gives no protocol timestamp: {e}"));
    Envelope::new(v, MessageId::from_ulid(Ulid::new()), ts, message)
}

fn hub_frame(v: u32, message: HubMessage) -> String {
    encode(&hub_envelope(v, message)).unwrap_or_else(|e| panic!("cannot encode a hub frame: {e}"))
}

fn make_tls(host: &str) -> Tls {
    let dir = crate::scratch_tempdir("felhom-devhub-");
    let certified =
        rcgen::generate_simple_self_signed(vec![host.to_string(), "localhost".to_string()])
            .unwrap_or_else(|e| panic!("cannot make a certificate: {e}"));
    let cert_der = certified.cert.der().clone();
    let fingerprint = hex::encode(Sha256::digest(cert_der.as_ref()));
    let cert_pem = dir.path().join("devhub.crt");
    std::fs::write(&cert_pem, certified.cert.pem())
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", cert_pem.display()));
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(certified.key_pair.serialize_der().into());
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap_or_else(|e| panic!("rustls protocol versions: {e}"))
    .with_no_client_auth()
    .with_single_cert(vec![cert_der], key)
    .unwrap_or_else(|e| panic!("rustls server config: {e}"));
    Tls {
        acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        cert_pem,
        fingerprint,
        _dir: dir,
    }
}

impl DevHub {
    /// The `[hub]` options that point an agent at this hub over plain `ws://` on loopback,
    /// with its credential.
    pub fn hub_options(&self) -> crate::fakepve::HubOptions {
        crate::fakepve::HubOptions {
            url: self.url(),
            token: self.token().to_string(),
            tls_fingerprint: None,
            ca_file: None,
        }
    }

    /// Start a hub with these options.
    pub fn start(opts: DevHubOptions) -> DevHub {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .thread_name("devhub")
            .build()
            .unwrap_or_else(|e| panic!("cannot start the dev hub runtime: {e}"));
        let tls = opts.tls.then(|| Arc::new(make_tls(&opts.host)));
        let (generation, _) = watch::channel(0u64);
        let shared = Arc::new(Shared {
            opts: opts.clone(),
            state: Mutex::new(HubState::default()),
            outgoing: Mutex::new(Vec::new()),
            ack: std::sync::atomic::AtomicBool::new(opts.ack),
            ignore_dispatch_acks: std::sync::atomic::AtomicBool::new(false),
            generation,
        });
        let wanted: SocketAddr = format!("{}:{}", opts.host, opts.port)
            .parse()
            .unwrap_or_else(|e| panic!("{}:{} is not an address: {e}", opts.host, opts.port));
        let listener = rt
            .block_on(bind(wanted))
            .unwrap_or_else(|e| panic!("the dev hub cannot listen on {wanted}: {e}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("no local address: {e}"));
        let mut hub = DevHub {
            rt,
            shared,
            addr,
            tls,
            running: false,
        };
        hub.spawn_listener(listener);
        hub
    }

    fn spawn_listener(&mut self, listener: TcpListener) {
        let shared = self.shared.clone();
        let tls = self.tls.clone();
        let my_gen = *shared.generation.borrow();
        shared.state().listeners += 1;
        self.rt.spawn(async move {
            accept_loop(listener, shared.clone(), tls, my_gen).await;
            shared.state().listeners -= 1;
        });
        self.running = true;
    }

    /// `ws://host:port/agent` (or `wss://`).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "wss" } else { "ws" };
        format!("{scheme}://{}{HUB_PATH}", self.addr)
    }

    /// The address listened on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The token the hub accepts.
    pub fn token(&self) -> &str {
        &self.shared.opts.token
    }

    /// The self-signed certificate (PEM), with TLS.
    pub fn cert_pem(&self) -> Option<&Path> {
        self.tls.as_ref().map(|t| t.cert_pem.as_path())
    }

    /// The SHA-256 of the certificate (hex), with TLS.
    pub fn fingerprint(&self) -> Option<&str> {
        self.tls.as_ref().map(|t| t.fingerprint.as_str())
    }

    /// Whether the hub is listening.
    pub fn is_running(&self) -> bool {
        self.running
    }

    /// Stop: close the port and drop every connection at once (no close frame).
    pub fn stop(&mut self) {
        self.shared.generation.send_modify(|g| *g += 1);
        self.running = false;
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            {
                let state = self.shared.state();
                if state.connected == 0 && state.listeners == 0 {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "dev hub connections did not close within {STOP_TIMEOUT:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Start listening again on the same address after [`DevHub::stop`].
    pub fn restart(&mut self) {
        assert!(!self.running, "the dev hub is already running");
        let deadline = Instant::now() + STOP_TIMEOUT;
        let listener = loop {
            match self.rt.block_on(bind(self.addr)) {
                Ok(l) => break l,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => panic!("the dev hub cannot listen on {} again: {e}", self.addr),
            }
        };
        self.spawn_listener(listener);
    }

    /// Send a dispatch for a new transaction; returns its transaction id. It is re-sent after
    /// every reconnect until the agent acknowledges it.
    pub fn dispatch(&self, action: DispatchAction) -> TxnId {
        let txn = TxnId::from_ulid(Ulid::new());
        self.dispatch_txn(Dispatch { txn, action });
        txn
    }

    /// Send this dispatch (a re-dispatch of a known transaction too) under a new message id,
    /// in each session's version.
    pub fn dispatch_txn(&self, dispatch: Dispatch) -> MessageId {
        let mut env = hub_envelope(HANDSHAKE_VERSION, HubMessage::Dispatch(dispatch.clone()));
        let id = env.id;
        // Record first, then send: a session starting now re-sends it from the record.
        let mut state = self.shared.state();
        state.dispatches.push(SentDispatch {
            id,
            dispatch,
            acked: false,
            sends: 0,
        });
        let outgoing = self
            .shared
            .outgoing
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut sent = false;
        for (_, version, tx) in outgoing.iter() {
            env.v = *version;
            let frame = encode(&env).unwrap_or_else(|e| panic!("cannot encode a dispatch: {e}"));
            sent |= tx.send(Message::text(frame)).is_ok();
        }
        if sent {
            if let Some(d) = state.dispatches.last_mut() {
                d.sends += 1;
            }
        }
        id
    }

    /// Send a text frame as it is to every open connection (bad frames for tests); returns
    /// how many connections it went to.
    pub fn send_raw(&self, text: impl Into<String>) -> usize {
        self.send_message(Message::text(text.into()))
    }

    /// Send a binary websocket message to every open connection.
    pub fn send_binary(&self, bytes: Vec<u8>) -> usize {
        self.send_message(Message::binary(bytes))
    }

    fn send_message(&self, message: Message) -> usize {
        let outgoing = self
            .shared
            .outgoing
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        outgoing
            .iter()
            .filter(|(_, _, tx)| tx.send(message.clone()).is_ok())
            .count()
    }

    /// Disregard (or not) the agent's acks of dispatches, as if they were lost: every
    /// dispatch sent meanwhile stays unacknowledged and is sent again after the next reconnect.
    pub fn set_ignore_dispatch_acks(&self, ignore: bool) {
        self.shared
            .ignore_dispatch_acks
            .store(ignore, std::sync::atomic::Ordering::SeqCst);
    }

    /// Turn acknowledging the agent's messages on or off.
    pub fn set_ack(&self, ack: bool) {
        self.shared
            .ack
            .store(ack, std::sync::atomic::Ordering::SeqCst);
    }

    /// A copy of what the hub recorded.
    pub fn snapshot(&self) -> HubState {
        self.shared.state().clone()
    }

    /// Wait until `ready` holds, for as long as `progress` keeps changing: fail only when it
    /// stood still for `stall`. For long batches whose total time depends on the machine's
    /// load, where only a stop of progress is a failure.
    pub fn wait_while_progressing(
        &self,
        what: &str,
        stall: Duration,
        ready: impl Fn(&HubState) -> bool,
        progress: impl Fn(&HubState) -> usize,
    ) -> HubState {
        let mut last = usize::MAX;
        let mut since = Instant::now();
        loop {
            {
                let state = self.shared.state();
                if ready(&state) {
                    return state.clone();
                }
                let now = progress(&state);
                if now != last {
                    last = now;
                    since = Instant::now();
                }
            }
            if since.elapsed() >= stall {
                let state = self.snapshot();
                panic!(
                    "dev hub: no progress for {stall:?} waiting for {what} (progress {last}, \
                     sessions {}, results {}, inventories {}, connected {})",
                    state.sessions,
                    state.results.len(),
                    state.inventories.len(),
                    state.connected
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Wait until `ready` holds for the recorded state, polling; panics after `timeout` naming
    /// `what`. Returns the state that satisfied it.
    pub fn wait_for(
        &self,
        what: &str,
        timeout: Duration,
        ready: impl Fn(&HubState) -> bool,
    ) -> HubState {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let state = self.shared.state();
                if ready(&state) {
                    return state.clone();
                }
            }
            if Instant::now() >= deadline {
                let state = self.snapshot();
                panic!(
                    "dev hub: timed out after {timeout:?} waiting for {what} (sessions {}, \
                     frames {}, results {}, inventories {}, connected {})",
                    state.sessions,
                    state.frames.len(),
                    state.results.len(),
                    state.inventories.len(),
                    state.connected
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for DevHub {
    fn drop(&mut self) {
        self.shared.generation.send_modify(|g| *g += 1);
    }
}

async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(128)
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    tls: Option<Arc<Tls>>,
    my_gen: u64,
) {
    let mut gen_rx = shared.generation.subscribe();
    loop {
        if *gen_rx.borrow_and_update() != my_gen {
            return;
        }
        tokio::select! {
            changed = gen_rx.changed() => {
                if changed.is_err() || *gen_rx.borrow() != my_gen {
                    return;
                }
            }
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                let tls = tls.clone();
                tokio::spawn(async move {
                    shared.state().connected += 1;
                    serve_connection(stream, shared.clone(), tls, my_gen).await;
                    shared.state().connected -= 1;
                });
            }
        }
    }
}

trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

async fn serve_connection(
    stream: TcpStream,
    shared: Arc<Shared>,
    tls: Option<Arc<Tls>>,
    my_gen: u64,
) {
    let mut gen_rx = shared.generation.subscribe();
    let stopped = |rx: &watch::Receiver<u64>| *rx.borrow() != my_gen;
    if stopped(&gen_rx) {
        return;
    }
    let io: Box<dyn Io> = match tls {
        Some(tls) => match tls.acceptor.accept(stream).await {
            Ok(s) => Box::new(s),
            Err(_) => return,
        },
        None => Box::new(stream),
    };
    let expected = format!("Bearer {}", shared.opts.token);
    let auth_shared = shared.clone();
    let check = move |request: &Request, response: Response| -> Result<Response, ErrorResponse> {
        let header = request
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        if header.as_deref() == Some(expected.as_str()) {
            Ok(response)
        } else {
            let mut state = auth_shared.state();
            state.refused.push(Instant::now());
            state.refused_headers.push(hex::encode(Sha256::digest(
                header.unwrap_or_default().as_bytes(),
            )));
            let mut refusal = ErrorResponse::new(Some("bad or missing bearer token".to_string()));
            *refusal.status_mut() = StatusCode::UNAUTHORIZED;
            Err(refusal)
        }
    };
    let config = WebSocketConfig::default()
        .max_message_size(Some(MAX_WS_MESSAGE))
        .max_frame_size(Some(MAX_WS_MESSAGE));
    let Ok(mut ws) = tokio_tungstenite::accept_hdr_async_with_config(io, check, Some(config)).await
    else {
        return;
    };

    // The hello.
    let (version, session) = loop {
        let next = tokio::select! {
            m = ws.next() => m,
            _ = gen_rx.changed() => if stopped(&gen_rx) { return } else { continue },
        };
        let text = match next {
            Some(Ok(Message::Text(t))) => t.to_string(),
            Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
            Some(Ok(_)) => continue,
        };
        let decoded = decode::<AgentMessage>(&text);
        record_frame(&shared, 0, &text, decoded.as_ref().ok());
        match decoded {
            Ok(Envelope {
                message: AgentMessage::Hello(hello),
                ..
            }) => {
                let Some(version) = negotiate(&hello.protocol_versions, &shared.opts.versions)
                else {
                    let pe = ProtocolError::new(
                        ProtocolErrorCode::UnsupportedVersion,
                        "no common protocol version",
                    );
                    let _ = ws
                        .send(Message::text(hub_frame(
                            HANDSHAKE_VERSION,
                            HubMessage::ProtocolError(pe),
                        )))
                        .await;
                    return;
                };
                let session = {
                    let mut state = shared.state();
                    state.hellos.push(hello);
                    state.sessions += 1;
                    state.session_versions.push(version);
                    state.sessions
                };
                let welcome = Welcome {
                    version,
                    session: shared
                        .opts
                        .session_name
                        .clone()
                        .unwrap_or_else(|| format!("devhub-{session}")),
                    heartbeat_interval_secs: std::num::NonZeroU32::new(
                        shared.opts.heartbeat_interval_secs.max(1),
                    )
                    .unwrap_or(std::num::NonZeroU32::MIN),
                };
                if ws
                    .send(Message::text(hub_frame(
                        HANDSHAKE_VERSION,
                        HubMessage::Welcome(welcome),
                    )))
                    .await
                    .is_err()
                {
                    return;
                }
                break (version, session);
            }
            Ok(other) => {
                let pe = ProtocolError::new(
                    ProtocolErrorCode::UnexpectedMessage,
                    format!("a `{}` before the hello", other.type_name()),
                )
                .with_offending_id(Some(other.id));
                let _ = ws
                    .send(Message::text(hub_frame(
                        HANDSHAKE_VERSION,
                        HubMessage::ProtocolError(pe),
                    )))
                    .await;
            }
            Err(pe) => {
                let _ = ws
                    .send(Message::text(hub_frame(
                        HANDSHAKE_VERSION,
                        HubMessage::ProtocolError(pe),
                    )))
                    .await;
            }
        }
    };

    // Register for outgoing frames, then re-send every dispatch not yet acknowledged.
    let (tx, mut rx) = mpsc::unbounded_channel::<Message>();
    let resend: Vec<String> = {
        let mut state = shared.state();
        shared
            .outgoing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((session, version, tx));
        state
            .dispatches
            .iter_mut()
            .filter(|d| !d.acked)
            .map(|d| {
                d.sends += 1;
                let env = Envelope::new(
                    version,
                    d.id,
                    felhom_agent::hub::outbox::now_timestamp()
                        .unwrap_or_else(|e| panic!("no timestamp: {e}")),
                    HubMessage::Dispatch(d.dispatch.clone()),
                );
                encode(&env).unwrap_or_else(|e| panic!("cannot encode: {e}"))
            })
            .collect()
    };
    let mut ok = true;
    for frame in resend {
        if ws.feed(Message::text(frame)).await.is_err() {
            ok = false;
            break;
        }
    }
    if ok && ws.flush().await.is_ok() {
        loop {
            tokio::select! {
                _ = gen_rx.changed() => if stopped(&gen_rx) { break },
                out = rx.recv() => match out {
                    Some(message) => if ws.send(message).await.is_err() { break },
                    None => break,
                },
                incoming = ws.next() => match incoming {
                    Some(Ok(Message::Text(t))) => {
                        let reply = receive(&shared, session, version, t.as_str());
                        if let Some(reply) = reply {
                            if ws.send(Message::text(reply)).await.is_err() { break }
                        }
                    }
                    Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                    Some(Ok(_)) => {}
                },
            }
        }
    }
    shared
        .outgoing
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|(s, _, _)| *s != session);
    // Dropping `ws` here closes the socket without a close frame.
}

fn record_frame(shared: &Shared, session: u64, text: &str, env: Option<&AgentEnvelope>) -> bool {
    let mut state = shared.state();
    let duplicate = match env {
        Some(env) if env.message.needs_ack() => !state.seen.insert(env.id),
        _ => false,
    };
    if duplicate {
        state.duplicates += 1;
    }
    state.frames.push(ReceivedFrame {
        session,
        text: text.to_string(),
        type_name: env.map(|e| e.type_name()),
        id: env.map(|e| e.id),
        duplicate,
    });
    duplicate
}

/// Record and apply one frame; the reply to send (an ack or a protocol error), if any.
fn receive(shared: &Shared, session: u64, version: u32, text: &str) -> Option<String> {
    let decoded = decode::<AgentMessage>(text).and_then(|env| {
        if env.v == version {
            return Ok(env);
        }
        Err(ProtocolError::new(
            ProtocolErrorCode::UnsupportedVersion,
            format!(
                "a frame in protocol version {} in a session of version {version}",
                env.v
            ),
        )
        .with_offending_id(Some(env.id)))
    });
    let duplicate = record_frame(shared, session, text, decoded.as_ref().ok());
    let env = match decoded {
        Ok(env) => env,
        Err(pe) => {
            shared.state().undecodable.push(pe.clone());
            return Some(hub_frame(version, HubMessage::ProtocolError(pe)));
        }
    };
    let id = env.id;
    let needs_ack = env.message.needs_ack();
    {
        let mut state = shared.state();
        match env.message {
            AgentMessage::Heartbeat(_) => state.heartbeats += 1,
            AgentMessage::Ack(_)
                if shared
                    .ignore_dispatch_acks
                    .load(std::sync::atomic::Ordering::SeqCst) => {}
            AgentMessage::Ack(Ack { ids }) => {
                let ids: HashSet<MessageId> = ids.into_iter().collect();
                for d in state.dispatches.iter_mut() {
                    if ids.contains(&d.id) {
                        d.acked = true;
                    }
                }
            }
            _ if duplicate => {}
            AgentMessage::Result(r) => state.results.entry(r.txn).or_default().push((id, r)),
            AgentMessage::Inventory(inv) => state.inventories.push((id, inv)),
            AgentMessage::Event(e) => state.events.push((id, e)),
            AgentMessage::Coverage(c) => state.coverages.push((id, c)),
            AgentMessage::ProtocolError(pe) => state.protocol_errors.push(pe),
            AgentMessage::Hello(h) => state.hellos.push(h),
        }
    }
    (needs_ack && shared.ack.load(std::sync::atomic::Ordering::SeqCst))
        .then(|| hub_frame(version, HubMessage::Ack(Ack { ids: vec![id] })))
}

/// `felhom-agent run` as a child process for the hub tests: stderr and stdout are collected
/// in memory, and the process is killed when the value is dropped.
pub struct AgentDaemon {
    child: std::process::Child,
    log: Arc<Mutex<String>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for AgentDaemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentDaemon")
            .field("pid", &self.child.id())
            .finish_non_exhaustive()
    }
}

/// Timing for the agent under test: quick reconnects and inventory polls.
pub const FAST_TIMING: &str =
    "backoff_initial_ms=50,backoff_cap_ms=400,inventory_poll_ms=300,shutdown_grace_ms=5000";

impl AgentDaemon {
    /// Start `felhom-agent --config <config> run` with `FELHOM_AGENT_HUB_TIMING=<timing>`
    /// and the extra environment `env`.
    pub fn spawn(config: &Path, timing: &str, env: &[(&str, &str)]) -> AgentDaemon {
        use std::io::BufRead;
        use std::process::Stdio;
        let mut cmd = crate::agent::agent_command(config);
        cmd.arg("-v")
            .arg("run")
            .env("FELHOM_AGENT_HUB_TIMING", timing)
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| {
            panic!("cannot start {}: {e}", crate::agent::agent_bin().display())
        });
        let log = Arc::new(Mutex::new(String::new()));
        let mut readers = Vec::new();
        let pipes: Vec<Box<dyn std::io::Read + Send>> = [
            child
                .stderr
                .take()
                .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
            child
                .stdout
                .take()
                .map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
        ]
        .into_iter()
        .flatten()
        .collect();
        for pipe in pipes {
            let log = log.clone();
            readers.push(std::thread::spawn(move || {
                for line in std::io::BufReader::new(pipe).lines() {
                    let Ok(line) = line else { break };
                    let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
                    log.push_str(&line);
                    log.push('\n');
                }
            }));
        }
        AgentDaemon {
            child,
            log,
            readers,
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the agent printed so far (stderr and stdout, interleaved by line).
    pub fn log(&self) -> String {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether the process still runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Send SIGTERM and wait up to `timeout` for the exit; panics (after SIGKILL) if it does
    /// not exit in time.
    pub fn terminate(mut self, timeout: Duration) -> (std::process::ExitStatus, String) {
        self.signal(nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return (status, self.finish()),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    panic!(
                        "the agent did not exit within {timeout:?} after SIGTERM; its log:\n{}",
                        self.finish()
                    );
                }
            }
        }
    }

    /// SIGKILL, then wait for it; returns the log.
    pub fn kill(mut self) -> String {
        self.signal(nix::sys::signal::Signal::SIGKILL);
        let _ = self.child.wait();
        self.finish()
    }

    fn signal(&self, signal: nix::sys::signal::Signal) {
        if let Ok(pid) = i32::try_from(self.child.id()) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), signal);
        }
    }

    fn finish(&mut self) -> String {
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
        self.log()
    }

    /// Wait until the log contains `needle`; panics after `timeout`.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.log().contains(needle) {
            assert!(
                Instant::now() < deadline,
                "the agent did not log {needle:?} within {timeout:?}; its log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for AgentDaemon {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "--- felhom-agent run log ---\n{}--- end of log ---",
                self.log()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_and_restart_keep_the_port() {
        let mut hub = DevHub::start(DevHubOptions::default());
        let url = hub.url();
        assert!(url.starts_with("ws://127.0.0.1:"), "{url}");
        hub.stop();
        assert!(
            std::net::TcpStream::connect(hub.addr()).is_err(),
            "still listening"
        );
        hub.restart();
        assert_eq!(hub.url(), url);
        assert!(std::net::TcpStream::connect(hub.addr()).is_ok());
    }
}
