//! One websocket session with the hub, and how to reach the hub.
//!
//! The agent connects to `[hub] url` and sends its credential as an `Authorization: Bearer
//! <token>` header on the websocket upgrade request (the header is marked sensitive; the token
//! is never logged or put into an error). `wss://` is verified with rustls: the pinned
//! certificate (`tls_fingerprint`), the CA file (`ca_file`) or, with neither, the system's
//! root certificates. `ws://` (no TLS) is accepted only for a hub on loopback (127.0.0.0/8,
//! `::1`, `localhost`): it exists for development and tests, and the token must never cross a
//! network in clear.
//!
//! A session: send `hello` (in [`HANDSHAKE_VERSION`]), wait for `welcome` (its version and
//! heartbeat interval), acknowledge it, then until it ends:
//! - re-send every message still waiting in the outbox, in order, then each new one as it is
//!   stored; in a session of protocol version 1 a waiting `coverage` (a type of version 2) is
//!   not sent but dropped from the outbox, since that hub cannot take it;
//! - a `heartbeat` (and a websocket ping, which the hub's pong answers) every interval; a hub
//!   silent for [`HUB_SILENCE_FACTOR`] intervals ends the session;
//! - `dispatch` goes to the dispatcher, which acknowledges it once it is stored; `ack` closes
//!   outbox entries; a hub `protocol_error` is logged and acknowledged;
//! - a frame that cannot be decoded (malformed, oversized, unknown type, wrong version) is
//!   answered with a `protocol_error` and not acknowledged; the session goes on, unless the hub
//!   sends more than [`MAX_BAD_FRAMES_PER_SESSION`]. A websocket message beyond
//!   [`WS_MAX_MESSAGE_BYTES`] cannot even be read and ends the session (the agent reconnects).
//!
//! Nothing here panics on input from the hub, and nothing here writes a secret anywhere.

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use hub_protocol::Message as _;
use hub_protocol::{
    decode, encode, negotiate, Ack, AgentEnvelope, AgentMessage, DispatchAction, Envelope,
    Heartbeat, Hello, HubEnvelope, HubMessage, MessageId, ProtocolError, ProtocolErrorCode,
    HANDSHAKE_VERSION, MAX_FRAME_BYTES, PROTOCOL_VERSION, SUPPORTED_VERSIONS,
};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Notify};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::header::{AUTHORIZATION, USER_AGENT};
use tokio_tungstenite::tungstenite::http::{HeaderValue, Uri};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self, Message};
use tokio_tungstenite::{Connector, MaybeTlsStream, WebSocketStream};
use tokio_util::sync::CancellationToken;
use ulid::Ulid;

use super::dispatch::{DispatchRunner, Dispatcher, InventoryRead};
use super::notify::{DaemonLoop, Liveness, Notifier, LIVENESS_TICK};
use super::outbox::{now_timestamp, Outbox};
use crate::config::{HubConfig, Secret};
use crate::error::{outside_text, ErrorCode, Failure};
use crate::tls::PinObserver;

/// Connecting (TCP, TLS, websocket upgrade) may take this long.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
/// The hub must answer the hello within this long.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(15);
/// Writing one batch of frames may take this long before the session is given up.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the inventory is read to find changes.
pub const INVENTORY_POLL_INTERVAL: Duration = Duration::from_secs(60);
/// How long running transactions get to reach a journaled step after SIGTERM.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(60);
/// How long closing the session may take at shutdown.
pub const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Heartbeat intervals of silence after which the hub is taken for gone.
pub const HUB_SILENCE_FACTOR: u32 = 3;
/// Undecodable frames a session tolerates before the agent closes it.
pub const MAX_BAD_FRAMES_PER_SESSION: u32 = 100;
/// The largest websocket message the agent reads at all. Larger than [`MAX_FRAME_BYTES`] so an
/// oversized frame can still be answered with a `protocol_error`.
pub const WS_MAX_MESSAGE_BYTES: usize = 4 * MAX_FRAME_BYTES;
/// The most ids in one `ack` frame.
pub const MAX_ACK_IDS: usize = 1000;
/// The environment variable that shortens the timing for development and tests (only in a
/// build with the `test-hooks` feature; the package is built without it):
/// `backoff_initial_ms=…,backoff_cap_ms=…,inventory_poll_ms=…,connect_timeout_ms=…,
/// handshake_timeout_ms=…,shutdown_grace_ms=…,hang_hub_loop_after_ms=…`.
#[cfg(feature = "test-hooks")]
pub const TIMING_ENV: &str = "FELHOM_AGENT_HUB_TIMING";

/// The timing of the hub session. [`Timing::default`] holds the named constants; a test build
/// can shorten them through its environment (see [`Timing::from_env`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timing {
    /// First reconnect window.
    pub backoff_initial: Duration,
    /// Largest reconnect window.
    pub backoff_cap: Duration,
    /// Connect timeout.
    pub connect_timeout: Duration,
    /// Hello → welcome timeout.
    pub handshake_timeout: Duration,
    /// Inventory poll interval.
    pub inventory_poll: Duration,
    /// Shutdown grace for running transactions.
    pub shutdown_grace: Duration,
    /// Test builds only: the session loop stops turning (awaits forever) this long after the
    /// start, to show that the watchdog then stops being fed.
    pub hang_hub_loop_after: Option<Duration>,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            backoff_initial: super::backoff::BACKOFF_INITIAL,
            backoff_cap: super::backoff::BACKOFF_CAP,
            connect_timeout: CONNECT_TIMEOUT,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            inventory_poll: INVENTORY_POLL_INTERVAL,
            shutdown_grace: SHUTDOWN_GRACE,
            hang_hub_loop_after: None,
        }
    }
}

impl Timing {
    /// The default timing. A build without the `test-hooks` feature reads no environment.
    #[cfg(not(feature = "test-hooks"))]
    pub fn from_env() -> Result<Self, Failure> {
        Ok(Self::default())
    }

    /// The default timing, changed by `TIMING_ENV` when it is set (test builds only).
    #[cfg(feature = "test-hooks")]
    pub fn from_env() -> Result<Self, Failure> {
        match std::env::var(TIMING_ENV) {
            Ok(text) => Self::parse(&text).map_err(|why| {
                Failure::new(
                    ErrorCode::ConfigInvalid,
                    format!("{TIMING_ENV}={text:?} is invalid: {why}"),
                )
            }),
            Err(_) => Ok(Self::default()),
        }
    }

    /// Parse `key=milliseconds` pairs separated by commas over the defaults. Each value is at
    /// least 10 ms.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut t = Self::default();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}` is not key=milliseconds"))?;
            let ms: u64 = value
                .trim()
                .parse()
                .map_err(|_| format!("`{value}` is not a number of milliseconds"))?;
            if ms < 10 {
                return Err(format!("{key} must be at least 10 ms"));
            }
            let d = Duration::from_millis(ms);
            match key.trim() {
                "backoff_initial_ms" => t.backoff_initial = d,
                "backoff_cap_ms" => t.backoff_cap = d,
                "connect_timeout_ms" => t.connect_timeout = d,
                "handshake_timeout_ms" => t.handshake_timeout = d,
                "inventory_poll_ms" => t.inventory_poll = d,
                "shutdown_grace_ms" => t.shutdown_grace = d,
                #[cfg(feature = "test-hooks")]
                "hang_hub_loop_after_ms" => t.hang_hub_loop_after = Some(d),
                other => return Err(format!("unknown key `{other}`")),
            }
        }
        Ok(t)
    }
}

/// How to reach the hub: its URL, credential and TLS connector.
pub struct HubEndpoint {
    url: String,
    token: Secret,
    connector: Connector,
    pin: Option<PinObserver>,
}

impl std::fmt::Debug for HubEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HubEndpoint")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// Whether a URL host is on loopback (`localhost`, 127.0.0.0/8, `::1`).
pub fn is_loopback_host(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    host.parse::<IpAddr>()
        .map(|ip| ip.is_loopback())
        .unwrap_or(false)
}

fn config_invalid(message: String) -> Failure {
    Failure::new(ErrorCode::ConfigInvalid, message)
}

/// The longest backup volume id a dispatch may name (PVE volids are far shorter).
pub const MAX_DISPATCH_SOURCE_BYTES: usize = 1024;
/// The longest storage id a dispatch may name.
pub const MAX_DISPATCH_STORAGE_BYTES: usize = 128;

/// Why a dispatch's strings are too long to be used (they end up in the journal, the results
/// and the log), if they are.
fn oversized_dispatch_field(action: &DispatchAction) -> Option<String> {
    if let DispatchAction::Provision { from, storage, .. } = action {
        for (field, value, max) in [
            ("from", from, MAX_DISPATCH_SOURCE_BYTES),
            ("storage", storage, MAX_DISPATCH_STORAGE_BYTES),
        ] {
            if value.len() > max {
                return Some(format!(
                    "dispatch field `{field}` holds {} bytes; at most {max} are accepted",
                    value.len()
                ));
            }
        }
    }
    None
}

impl HubEndpoint {
    /// Check `[hub]` and build its TLS connector. Nothing is sent.
    pub fn new(cfg: &HubConfig) -> Result<Self, Failure> {
        let uri: Uri = cfg
            .url
            .parse()
            .map_err(|e| config_invalid(format!("[hub] url {:?} is not a URL: {e}", cfg.url)))?;
        let host = uri
            .host()
            .ok_or_else(|| config_invalid(format!("[hub] url {:?} has no host", cfg.url)))?;
        let (connector, pin) = match uri.scheme_str() {
            Some("wss") => {
                let (config, pin) = match &cfg.tls {
                    Some(trust) => {
                        let (config, observer) = crate::tls::client_config(trust)
                            .map_err(|e| config_invalid(format!("[hub] TLS: {e}")))?;
                        (config, Some(observer))
                    }
                    None => (system_roots_config()?, None),
                };
                (Connector::Rustls(Arc::new(config)), pin)
            }
            Some("ws") if is_loopback_host(host) => (Connector::Plain, None),
            Some("ws") => {
                return Err(config_invalid(format!(
                    "[hub] url {:?} uses ws:// (no TLS) to a host that is not on loopback; the \
                     hub credential must never cross a network in clear: use wss://",
                    cfg.url
                )))
            }
            _ => {
                return Err(config_invalid(format!(
                    "[hub] url {:?} must start with wss://",
                    cfg.url
                )))
            }
        };
        Ok(Self {
            url: cfg.url.clone(),
            token: cfg.token.clone(),
            connector,
            pin,
        })
    }

    /// The hub's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Open a websocket to the hub with the bearer credential.
    pub async fn connect(&self, timeout: Duration) -> Result<HubSocket, SessionEnd> {
        if let Some(pin) = &self.pin {
            pin.reset();
        }
        let mut request = self
            .url
            .as_str()
            .into_client_request()
            .map_err(|e| SessionEnd::Connect(format!("bad hub URL: {e}")))?;
        let mut auth =
            HeaderValue::from_str(&format!("Bearer {}", self.token.expose())).map_err(|_| {
                SessionEnd::Connect(
                    "the hub credential holds characters not allowed in an HTTP header; check \
                     [hub] token_file"
                        .to_string(),
                )
            })?;
        auth.set_sensitive(true);
        request.headers_mut().insert(AUTHORIZATION, auth);
        request.headers_mut().insert(
            USER_AGENT,
            HeaderValue::from_static(concat!("felhom-agent/", env!("CARGO_PKG_VERSION"))),
        );
        let config = WebSocketConfig::default()
            .read_buffer_size(16 * 1024)
            .write_buffer_size(16 * 1024)
            .max_message_size(Some(WS_MAX_MESSAGE_BYTES))
            .max_frame_size(Some(WS_MAX_MESSAGE_BYTES));
        let connecting = tokio_tungstenite::connect_async_tls_with_config(
            request,
            Some(config),
            true,
            Some(self.connector.clone()),
        );
        match tokio::time::timeout(timeout, connecting).await {
            Err(_) => Err(SessionEnd::Connect(format!(
                "no connection within {} s",
                timeout.as_secs_f32()
            ))),
            Ok(Ok((ws, _response))) => Ok(ws),
            Ok(Err(e)) => Err(self.connect_error(e)),
        }
    }

    fn connect_error(&self, e: tungstenite::Error) -> SessionEnd {
        if let Some(seen) = self.pin.as_ref().and_then(PinObserver::mismatch) {
            return SessionEnd::TlsPinMismatch { seen };
        }
        match e {
            tungstenite::Error::Http(response) => {
                let status = response.status();
                if status.as_u16() == 401 || status.as_u16() == 403 {
                    SessionEnd::Unauthorized {
                        status: status.as_u16(),
                    }
                } else {
                    SessionEnd::Connect(format!("the hub answered the upgrade with HTTP {status}"))
                }
            }
            other => SessionEnd::Connect(other.to_string()),
        }
    }
}

fn system_roots_config() -> Result<rustls::ClientConfig, Failure> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = rustls::RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        return Err(config_invalid(
            "[hub] has neither tls_fingerprint nor ca_file and the system has no usable CA \
             certificates (install ca-certificates, or set ca_file / tls_fingerprint)"
                .to_string(),
        ));
    }
    rustls::ClientConfig::builder_with_provider(crate::tls::provider())
        .with_safe_default_protocol_versions()
        .map(|b| b.with_root_certificates(roots).with_no_client_auth())
        .map_err(|e| config_invalid(format!("[hub] TLS setup failed: {e}")))
}

/// The websocket to the hub.
pub type HubSocket = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Why a session (or an attempt at one) ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionEnd {
    /// No websocket could be opened.
    Connect(String),
    /// The hub refused the credential at the upgrade.
    Unauthorized {
        /// 401 or 403.
        status: u16,
    },
    /// The hub's certificate does not match the pin.
    TlsPinMismatch {
        /// The fingerprint seen.
        seen: String,
    },
    /// The hello was not answered with a welcome.
    Handshake(String),
    /// The hub closed the session.
    Closed,
    /// The websocket failed.
    Transport(String),
    /// Nothing was heard from the hub for this long.
    Silent(Duration),
    /// The hub sent too many frames that could not be decoded.
    TooManyBadFrames,
    /// The agent is stopping.
    Stopped,
}

impl std::fmt::Display for SessionEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Connect(why) => write!(f, "cannot connect: {why}"),
            Self::Unauthorized { status } => write!(
                f,
                "the hub refused the credential (HTTP {status}); check [hub] token_file"
            ),
            Self::TlsPinMismatch { seen } => write!(
                f,
                "[tls_pin_mismatch] the hub's certificate has fingerprint {seen}, which is not \
                 the pinned [hub] tls_fingerprint"
            ),
            Self::Handshake(why) => write!(f, "handshake failed: {why}"),
            Self::Closed => write!(f, "the hub closed the session"),
            Self::Transport(why) => write!(f, "the connection failed: {why}"),
            Self::Silent(d) => write!(f, "nothing heard from the hub for {} s", d.as_secs()),
            Self::TooManyBadFrames => write!(
                f,
                "the hub sent more than {MAX_BAD_FRAMES_PER_SESSION} frames that could not be \
                 decoded"
            ),
            Self::Stopped => write!(f, "the agent is stopping"),
        }
    }
}

/// Everything a session needs from the daemon.
pub struct SessionContext<'a, R, I> {
    /// Where the hub is.
    pub endpoint: &'a HubEndpoint,
    /// The timing.
    pub timing: &'a Timing,
    /// This node.
    pub node: &'a str,
    /// The fleet's pool.
    pub pool: &'a str,
    /// The outbox.
    pub outbox: &'a Outbox,
    /// The dispatcher.
    pub dispatcher: &'a Dispatcher<R, I>,
    /// Where the session loop says it turns (read by the watchdog).
    pub liveness: &'a Liveness,
    /// systemd.
    pub notifier: &'a Notifier,
    /// Set once READY=1 was sent.
    pub ready_sent: &'a AtomicBool,
    /// Asks the inventory poller for an inventory now.
    pub inventory_now: &'a Notify,
    /// When the hub was last heard from (for the metrics).
    pub contact: &'a super::HubContact,
    /// When the agent started (for the heartbeat's uptime).
    pub started: Instant,
}

/// How a session went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionOutcome {
    /// The welcome was received.
    pub welcomed: bool,
    /// Why it ended.
    pub end: SessionEnd,
}

fn envelope(v: u32, message: AgentMessage) -> Option<AgentEnvelope> {
    let ts = now_timestamp().ok()?;
    Some(Envelope::new(
        v,
        MessageId::from_ulid(Ulid::new()),
        ts,
        message,
    ))
}

/// A frame for this session's version. Stored frames are written in [`PROTOCOL_VERSION`]; a
/// session in another version gets them re-encoded with its `v` (id, timestamp and body
/// unchanged). `Err` with the message type when that version has no such message (a
/// `coverage` in a version 1 session): it cannot be sent in this session.
fn frame_for_version(frame: String, v: u32) -> Result<String, &'static str> {
    if v == PROTOCOL_VERSION {
        return Ok(frame);
    }
    match decode::<AgentMessage>(&frame) {
        Ok(env) if env.message.since() > v => Err(env.type_name()),
        Ok(mut env) => {
            env.v = v;
            Ok(encode(&env).unwrap_or(frame))
        }
        Err(_) => Ok(frame),
    }
}

struct Session<'s, 'a, R, I> {
    ctx: &'s SessionContext<'a, R, I>,
    ws: HubSocket,
    version: u32,
    heartbeat: Duration,
    last_heard: Instant,
    bad_frames: u32,
    heartbeat_seq: u64,
    sent_up_to: u64,
}

impl<R: DispatchRunner, I: InventoryRead> SessionContext<'_, R, I> {
    fn heard(&self) {
        self.liveness.beat(DaemonLoop::Hub);
        self.contact.heard();
    }

    fn hello(&self) -> Hello {
        Hello {
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            node: self.node.to_string(),
            pool: self.pool.to_string(),
            protocol_versions: SUPPORTED_VERSIONS.to_vec(),
            capabilities: self.dispatcher.capabilities(),
            host: super::facts::host_facts(),
        }
    }

    /// Connect and serve one session until it ends. `acks` carries the ids of hub messages to
    /// acknowledge (from the dispatcher); `stop` ends the session cleanly.
    pub async fn run(
        &self,
        acks: &mut mpsc::UnboundedReceiver<MessageId>,
        stop: &CancellationToken,
    ) -> SessionOutcome {
        let connected = self
            .liveness
            .beat_while(DaemonLoop::Hub, async {
                tokio::select! {
                    r = self.endpoint.connect(self.timing.connect_timeout) => r,
                    _ = stop.cancelled() => Err(SessionEnd::Stopped),
                }
            })
            .await;
        let ws = match connected {
            Ok(ws) => ws,
            Err(end) => {
                return SessionOutcome {
                    welcomed: false,
                    end,
                }
            }
        };
        let mut session = Session {
            ctx: self,
            ws,
            version: HANDSHAKE_VERSION,
            heartbeat: Duration::from_secs(30),
            last_heard: Instant::now(),
            bad_frames: 0,
            heartbeat_seq: 0,
            sent_up_to: 0,
        };
        let handshake = self
            .liveness
            .beat_while(DaemonLoop::Hub, session.handshake(stop))
            .await;
        if let Err(end) = handshake {
            self.contact.lost();
            session.close().await;
            return SessionOutcome {
                welcomed: false,
                end,
            };
        }
        let end = session.serve(acks, stop).await;
        self.contact.lost();
        session.close().await;
        SessionOutcome {
            welcomed: true,
            end,
        }
    }
}

/// Completes at `started + after` (never without `after`, which only test builds set).
async fn hang_after(after: Option<Duration>, started: Instant) {
    match after {
        Some(after) => tokio::time::sleep_until((started + after).into()).await,
        None => std::future::pending::<()>().await,
    }
}

/// The head of a frame, for the log: its type and id, nothing of its body.
#[derive(serde::Deserialize)]
struct FrameHead<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<std::borrow::Cow<'a, str>>,
    #[serde(borrow, default)]
    id: Option<std::borrow::Cow<'a, str>>,
}

/// One log line per hub frame: direction, type, id, size (never the body). Heartbeats at
/// `trace`, everything else at `debug`.
fn log_frame(direction: &'static str, frame: &str) {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return;
    }
    let head: Option<FrameHead<'_>> = serde_json::from_str(frame).ok();
    let kind = head
        .as_ref()
        .and_then(|h| h.kind.as_deref())
        .unwrap_or("?")
        .to_owned();
    let id = head
        .as_ref()
        .and_then(|h| h.id.as_deref())
        .unwrap_or("-")
        .to_owned();
    let bytes = frame.len();
    if kind == "heartbeat" {
        tracing::trace!(direction, r#type = %kind, id = %id, bytes, "hub frame");
    } else {
        tracing::debug!(direction, r#type = %kind, id = %id, bytes, "hub frame");
    }
}

impl<R: DispatchRunner, I: InventoryRead> Session<'_, '_, R, I> {
    async fn send_frames(&mut self, frames: Vec<String>) -> Result<(), SessionEnd> {
        let ws = &mut self.ws;
        let sending = async {
            for frame in frames {
                log_frame("sent", &frame);
                ws.feed(Message::text(frame)).await?;
            }
            ws.flush().await
        };
        match tokio::time::timeout(SEND_TIMEOUT, sending).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(SessionEnd::Transport(e.to_string())),
            Err(_) => Err(SessionEnd::Transport(format!(
                "the hub did not take our frames within {} s",
                SEND_TIMEOUT.as_secs()
            ))),
        }
    }

    async fn send(&mut self, message: AgentMessage) -> Result<(), SessionEnd> {
        let Some(env) = envelope(self.version, message) else {
            return Ok(());
        };
        match encode(&env) {
            Ok(frame) => self.send_frames(vec![frame]).await,
            Err(e) => {
                tracing::error!("cannot encode a `{}` frame: {e}", env.type_name());
                Ok(())
            }
        }
    }

    async fn send_protocol_error(&mut self, error: ProtocolError) -> Result<(), SessionEnd> {
        self.send(AgentMessage::ProtocolError(error)).await
    }

    async fn send_acks(&mut self, mut ids: Vec<MessageId>) -> Result<(), SessionEnd> {
        while !ids.is_empty() {
            let rest = ids.split_off(ids.len().min(MAX_ACK_IDS));
            self.send(AgentMessage::Ack(Ack { ids })).await?;
            ids = rest;
        }
        Ok(())
    }

    async fn handshake(&mut self, stop: &CancellationToken) -> Result<(), SessionEnd> {
        let hello = self.ctx.hello();
        self.send(AgentMessage::Hello(hello)).await?;
        let deadline = tokio::time::Instant::now() + self.ctx.timing.handshake_timeout;
        loop {
            let next = tokio::select! {
                m = tokio::time::timeout_at(deadline, self.ws.next()) => m,
                _ = stop.cancelled() => return Err(SessionEnd::Stopped),
            };
            let text = match next {
                Err(_) => {
                    return Err(SessionEnd::Handshake(format!(
                        "no welcome within {} s",
                        self.ctx.timing.handshake_timeout.as_secs_f32()
                    )))
                }
                Ok(None) => return Err(SessionEnd::Closed),
                Ok(Some(Err(e))) => return Err(SessionEnd::Transport(e.to_string())),
                Ok(Some(Ok(Message::Text(t)))) => t,
                Ok(Some(Ok(Message::Close(_)))) => return Err(SessionEnd::Closed),
                Ok(Some(Ok(Message::Binary(_)))) => {
                    self.bad_binary().await?;
                    continue;
                }
                Ok(Some(Ok(_))) => continue,
            };
            log_frame("received", text.as_str());
            self.last_heard = Instant::now();
            self.ctx.heard();
            let env: HubEnvelope = match decode(text.as_str()) {
                Ok(env) => env,
                Err(pe) => {
                    self.bad_frame(pe).await?;
                    continue;
                }
            };
            match env.message {
                HubMessage::Welcome(w) => {
                    if negotiate(SUPPORTED_VERSIONS, &[w.version]).is_none() {
                        let pe = ProtocolError::new(
                            ProtocolErrorCode::UnsupportedVersion,
                            format!(
                                "the welcome chose protocol version {}, which this agent does not \
                                 speak (it speaks {SUPPORTED_VERSIONS:?})",
                                w.version
                            ),
                        )
                        .with_offending_id(Some(env.id));
                        let _ = self.send_protocol_error(pe).await;
                        return Err(SessionEnd::Handshake(format!(
                            "the hub chose protocol version {}, which this agent does not speak",
                            w.version
                        )));
                    }
                    self.version = w.version;
                    self.heartbeat =
                        Duration::from_secs(u64::from(w.heartbeat_interval_secs.get()));
                    self.send_acks(vec![env.id]).await?;
                    let session = outside_text(&w.session);
                    tracing::info!(
                        session = %session,
                        "connected to the hub at {} (session {}, protocol {}, heartbeat every {} s)",
                        self.ctx.endpoint.url(),
                        session,
                        w.version,
                        self.heartbeat.as_secs()
                    );
                    return Ok(());
                }
                HubMessage::ProtocolError(pe) => {
                    return Err(SessionEnd::Handshake(format!(
                        "the hub refused the hello: {}",
                        outside_text(&pe.to_string())
                    )));
                }
                other => {
                    let pe = ProtocolError::new(
                        ProtocolErrorCode::UnexpectedMessage,
                        format!(
                            "a `{}` before the welcome; the agent sends nothing but its hello \
                             until it is welcomed",
                            hub_type_name(&other)
                        ),
                    )
                    .with_offending_id(Some(env.id));
                    self.send_protocol_error(pe).await?;
                }
            }
        }
    }

    async fn bad_binary(&mut self) -> Result<(), SessionEnd> {
        self.bad_frame(ProtocolError::new(
            ProtocolErrorCode::Malformed,
            "a binary websocket message; frames are JSON text messages",
        ))
        .await
    }

    async fn bad_frame(&mut self, error: ProtocolError) -> Result<(), SessionEnd> {
        self.bad_frames += 1;
        tracing::warn!(
            "the hub sent a frame that cannot be used: {}",
            outside_text(&error.to_string())
        );
        self.send_protocol_error(error).await?;
        if self.bad_frames > MAX_BAD_FRAMES_PER_SESSION {
            return Err(SessionEnd::TooManyBadFrames);
        }
        Ok(())
    }

    async fn serve(
        &mut self,
        acks: &mut mpsc::UnboundedReceiver<MessageId>,
        stop: &CancellationToken,
    ) -> SessionEnd {
        match self.serve_inner(acks, stop).await {
            Ok(()) => SessionEnd::Stopped,
            Err(end) => end,
        }
    }

    async fn serve_inner(
        &mut self,
        acks: &mut mpsc::UnboundedReceiver<MessageId>,
        stop: &CancellationToken,
    ) -> Result<(), SessionEnd> {
        if !self.ctx.ready_sent.swap(true, Ordering::SeqCst) {
            self.ctx.notifier.ready(&format!(
                "connected to the hub at {}",
                self.ctx.endpoint.url()
            ));
        } else {
            self.ctx.notifier.status(&format!(
                "connected to the hub at {}",
                self.ctx.endpoint.url()
            ));
        }
        self.ctx.inventory_now.notify_one();
        let mut stored = self.ctx.outbox.subscribe();
        let mut ticker =
            tokio::time::interval_at(tokio::time::Instant::now() + self.heartbeat, self.heartbeat);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut alive = tokio::time::interval(LIVENESS_TICK);
        alive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Everything waiting is re-sent first, in order, then each new message as it is
        // stored. The backlog goes out one batch per turn of the loop, so the hub's acks and
        // dispatches are read in between and neither side blocks on a full socket.
        loop {
            let backlog = *stored.borrow_and_update() > self.sent_up_to;
            tokio::select! {
                biased;
                _ = stop.cancelled() => {
                    // Flush what is waiting, then close.
                    let _ = tokio::time::timeout(CLOSE_TIMEOUT, self.send_all_pending()).await;
                    return Ok(());
                }
                Some(id) = acks.recv() => {
                    let mut ids = vec![id];
                    while let Ok(more) = acks.try_recv() {
                        ids.push(more);
                    }
                    self.send_acks(ids).await?;
                }
                _ = ticker.tick() => self.beat().await?,
                _ = alive.tick() => self.ctx.liveness.beat(DaemonLoop::Hub),
                () = hang_after(self.ctx.timing.hang_hub_loop_after, self.ctx.started) => {
                    tracing::warn!("test hook: the hub loop stops turning now");
                    std::future::pending::<()>().await;
                }
                incoming = self.ws.next() => match incoming {
                    None => return Err(SessionEnd::Closed),
                    Some(Err(e)) => return Err(SessionEnd::Transport(e.to_string())),
                    Some(Ok(message)) => self.receive(message).await?,
                },
                () = std::future::ready(()), if backlog => self.send_pending().await?,
                _ = stored.changed(), if !backlog => {}
            }
        }
    }

    async fn send_all_pending(&mut self) -> Result<(), SessionEnd> {
        loop {
            let before = self.sent_up_to;
            self.send_pending().await?;
            if self.sent_up_to == before || *self.ctx.outbox.subscribe().borrow() <= self.sent_up_to
            {
                return Ok(());
            }
        }
    }

    async fn beat(&mut self) -> Result<(), SessionEnd> {
        let silent = self.last_heard.elapsed();
        if silent > self.heartbeat * HUB_SILENCE_FACTOR {
            return Err(SessionEnd::Silent(silent));
        }
        self.heartbeat_seq += 1;
        let beat = Heartbeat {
            seq: self.heartbeat_seq,
            uptime_secs: self.ctx.started.elapsed().as_secs(),
            in_flight: self.ctx.dispatcher.in_flight(),
            outbox_depth: self.ctx.outbox.depth(),
        };
        self.send(AgentMessage::Heartbeat(beat)).await?;
        // The hub's pong shows it is there even when it has nothing to say.
        match tokio::time::timeout(SEND_TIMEOUT, self.ws.send(Message::Ping(Vec::new().into())))
            .await
        {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(SessionEnd::Transport(e.to_string())),
            Err(_) => Err(SessionEnd::Transport(
                "the ping could not be sent".to_string(),
            )),
        }
    }

    async fn send_pending(&mut self) -> Result<(), SessionEnd> {
        let batch = self
            .ctx
            .outbox
            .pending_after(self.sent_up_to)
            .await
            .map_err(|e| SessionEnd::Transport(format!("cannot read the outbox: {e}")))?;
        let Some(last) = batch.last().map(|o| o.seq) else {
            self.sent_up_to = self.sent_up_to.max(*self.ctx.outbox.subscribe().borrow());
            return Ok(());
        };
        let mut frames = Vec::with_capacity(batch.len());
        let mut dropped = Vec::new();
        for o in batch {
            match frame_for_version(o.frame, self.version) {
                Ok(frame) => frames.push(frame),
                Err(type_name) => {
                    tracing::info!(
                        id = %o.id,
                        "the hub speaks protocol version {}, which has no `{type_name}` message; message {} is dropped from the outbox unsent",
                        self.version,
                        o.id
                    );
                    dropped.push(o.id);
                }
            }
        }
        self.ctx.outbox.ack(dropped);
        if !frames.is_empty() {
            self.send_frames(frames).await?;
        }
        self.sent_up_to = last;
        Ok(())
    }

    async fn receive(&mut self, message: Message) -> Result<(), SessionEnd> {
        self.last_heard = Instant::now();
        self.ctx.heard();
        let text = match message {
            Message::Text(t) => t,
            Message::Binary(_) => return self.bad_binary().await,
            Message::Close(_) => return Err(SessionEnd::Closed),
            Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => return Ok(()),
        };
        log_frame("received", text.as_str());
        let env: HubEnvelope = match decode(text.as_str()) {
            Ok(env) => env,
            Err(pe) => return self.bad_frame(pe).await,
        };
        if env.v != self.version {
            let pe = ProtocolError::new(
                ProtocolErrorCode::UnsupportedVersion,
                format!(
                    "a frame in protocol version {} in a session of version {}",
                    env.v, self.version
                ),
            )
            .with_offending_id(Some(env.id));
            return self.bad_frame(pe).await;
        }
        match env.message {
            HubMessage::Dispatch(d) => {
                if let Some(why) = oversized_dispatch_field(&d.action) {
                    let pe = ProtocolError::new(ProtocolErrorCode::Malformed, why)
                        .with_offending_id(Some(env.id));
                    return self.bad_frame(pe).await;
                }
                tracing::debug!(txn = %d.txn, "dispatch {} (message {})", d.txn, env.id);
                self.ctx.dispatcher.accept(env.id, d);
                Ok(())
            }
            HubMessage::Ack(ack) => {
                self.ctx.outbox.ack(ack.ids);
                Ok(())
            }
            HubMessage::ProtocolError(pe) => {
                tracing::warn!(
                    "the hub did not accept one of our messages (it stays in the outbox): {}",
                    outside_text(&pe.to_string())
                );
                self.send_acks(vec![env.id]).await
            }
            HubMessage::Welcome(_) => {
                let pe = ProtocolError::new(
                    ProtocolErrorCode::UnexpectedMessage,
                    "a second welcome in one session",
                )
                .with_offending_id(Some(env.id));
                self.send_protocol_error(pe).await?;
                self.send_acks(vec![env.id]).await
            }
        }
    }

    async fn close(&mut self) {
        let _ = tokio::time::timeout(CLOSE_TIMEOUT, self.ws.close(None)).await;
    }
}

fn hub_type_name(message: &HubMessage) -> &'static str {
    use hub_protocol::Message as _;
    message.type_name()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TlsTrust;

    #[test]
    fn timing_parses_over_the_defaults() {
        let t = Timing::parse("backoff_initial_ms=50, backoff_cap_ms=400,inventory_poll_ms=200")
            .expect("parse");
        assert_eq!(t.backoff_initial, Duration::from_millis(50));
        assert_eq!(t.backoff_cap, Duration::from_millis(400));
        assert_eq!(t.inventory_poll, Duration::from_millis(200));
        assert_eq!(t.connect_timeout, CONNECT_TIMEOUT);
        assert_eq!(Timing::parse("").expect("empty"), Timing::default());
        for bad in [
            "backoff_ms=5",
            "backoff_initial_ms",
            "backoff_initial_ms=x",
            "backoff_cap_ms=1",
        ] {
            assert!(Timing::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn loopback_hosts() {
        for h in [
            "127.0.0.1",
            "127.42.0.9",
            "localhost",
            "[::1]",
            "::1",
            "LOCALHOST",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in [
            "10.0.0.1",
            "hub.example.net",
            "128.0.0.1",
            "[::2]",
            "localhost.example",
        ] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }

    fn hub(url: &str, tls: Option<TlsTrust>) -> HubConfig {
        HubConfig {
            url: url.to_string(),
            token_file: "/nonexistent".into(),
            token: Secret::new("s3cret-token"),
            tls,
        }
    }

    #[test]
    fn ws_is_only_for_loopback_and_errors_never_show_the_token() {
        assert!(HubEndpoint::new(&hub("ws://127.0.0.1:9000/agent", None)).is_ok());
        let e = HubEndpoint::new(&hub("ws://hub.example.net/agent", None)).unwrap_err();
        assert_eq!(e.code, ErrorCode::ConfigInvalid);
        assert!(e.message.contains("wss://"), "{}", e.message);
        let e = HubEndpoint::new(&hub("http://hub.example.net/agent", None)).unwrap_err();
        assert!(e.message.contains("wss://"), "{}", e.message);
        assert!(HubEndpoint::new(&hub(
            "wss://hub.example.net/agent",
            Some(TlsTrust::Pin([7; 32]))
        ))
        .is_ok());
        let ep = HubEndpoint::new(&hub("ws://127.0.0.1:9/agent", None)).expect("endpoint");
        assert!(!format!("{ep:?}").contains("s3cret"));
    }

    #[tokio::test]
    async fn connection_failures_name_no_secret() {
        // A port nobody listens on (bound then closed).
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let ep = HubEndpoint::new(&hub(&format!("ws://127.0.0.1:{port}/agent"), None))
            .expect("endpoint");
        let end = match ep.connect(Duration::from_secs(5)).await {
            Ok(_) => panic!("connected to a closed port"),
            Err(end) => end,
        };
        assert!(matches!(end, SessionEnd::Connect(_)), "{end}");
        assert!(!end.to_string().contains("s3cret"), "{end}");
    }

    #[test]
    fn stored_frames_keep_their_bytes_in_the_current_version() {
        let frame = "{\"v\":1,\"id\":\"x\"}".to_string();
        assert_eq!(
            frame_for_version(frame.clone(), PROTOCOL_VERSION),
            Ok(frame)
        );
    }

    fn stored(message: AgentMessage) -> String {
        encode(&Envelope::new(
            PROTOCOL_VERSION,
            MessageId::from_ulid(Ulid::new()),
            now_timestamp().expect("now"),
            message,
        ))
        .expect("encode")
    }

    #[test]
    fn a_version_1_session_gets_v1_frames_and_no_coverage() {
        let beat = stored(AgentMessage::Heartbeat(Heartbeat {
            seq: 1,
            uptime_secs: 1,
            in_flight: 0,
            outbox_depth: 0,
        }));
        let v1 = frame_for_version(beat, 1).expect("a heartbeat exists in version 1");
        let env: AgentEnvelope = decode(&v1).expect("decodes");
        assert_eq!(env.v, 1);
        let table = stored(AgentMessage::Coverage(hub_protocol::Coverage {
            node: "pve1".to_string(),
            at: now_timestamp().expect("now"),
            guest_count: 0,
            guests: vec![],
        }));
        assert_eq!(frame_for_version(table.clone(), 1), Err("coverage"));
        assert_eq!(frame_for_version(table.clone(), 2), Ok(table));
    }
}
