//! The endpoint picker's gRPC transport: Envoy's ext_proc stream and gRPC health, served in Rust so
//! that HTTP/2, TLS and gRPC framing cost no Python (gRPC's Python server spent about 1 ms of CPU on
//! the four messages of one small request; this, about 0.2 ms).
//!
//! Messages cross as bytes, unparsed: the picker (router_runtime/gateway/picker.py) decodes and
//! answers them on its event loop. Rust threads never take the GIL: they queue events in an inbox and
//! write one byte to a socket the loop watches (once per drain, not per event); the loop drains the
//! inbox and answers through `send` / `finish`, which only hand bytes to the Rust side's channels.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::future::Future;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener as StdListener, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes};
use http_body_util::BodyExt;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, Notify, Semaphore};
use tokio::time::Sleep;
use tokio_stream::wrappers::ReceiverStream;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::server::{Grpc, StreamingService, UnaryService};
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Code, Request, Response, Status, Streaming};

const PROCESS: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";
const CHECK: &str = "/grpc.health.v1.Health/Check";

/// How many message caps of answers a stream may have waiting for its client to read them.
const UNREAD_CAPS: usize = 2;
/// A health check Python has not answered in this long fails UNAVAILABLE (the loop is stuck).
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a call to a method not served here is read before it is refused.
const UNSERVED_READ: Duration = Duration::from_secs(1);

/// What the inbox holds, as Python reads it: (id, kind, payload).
pub const OPENED: u8 = 0; // a Process stream opened
pub const MESSAGE: u8 = 1; // one of its messages (payload: the serialized ProcessingRequest)
pub const ENDED: u8 = 2; // the client closed its side: no more messages
pub const RESET: u8 = 3; // the stream is gone before Python finished it (cancelled, reset, lost)
pub const CHECK_ASKED: u8 = 4; // a health check (payload: the serialized HealthCheckRequest)

type Answer = Result<Bytes, Status>;

struct Inbox {
    events: VecDeque<(u64, u8, Option<Bytes>)>,
    notified: bool,
}

/// One open Process stream, as both sides see it until Python finishes it (or it is reset).
struct Open {
    answers: mpsc::UnboundedSender<Answer>,
    /// Bytes the stream may still have queued for Python: its reader waits for credit, so a client
    /// cannot queue more than one message cap per stream however fast it sends (`consumed` returns it).
    credit: Arc<Semaphore>,
    /// Told when the stream is over for Python: its reader stops reading and drops the request side.
    over: Arc<Notify>,
    /// Answer bytes given but not yet taken by the connection: a client that does not read its
    /// answers ends its stream once they pass `UNREAD_CAPS` message caps, rather than hold memory.
    unread: Arc<AtomicUsize>,
}

impl Open {
    fn end(self, status: Option<Status>) {
        if let Some(s) = status {
            let _ = self.answers.send(Err(s));
        }
        self.credit.close();
        self.over.notify_one();
    }
}

struct Shared {
    inbox: Mutex<Inbox>,
    wake: UnixStream,
    streams: Mutex<HashMap<u64, Open>>,
    checks: Mutex<HashMap<u64, oneshot::Sender<Answer>>>,
    next: AtomicU64,
    process: bool,
    max_message: usize,
}

impl Shared {
    fn push(&self, id: u64, kind: u8, payload: Option<Bytes>) {
        let mut inbox = self.inbox.lock().unwrap();
        inbox.events.push_back((id, kind, payload));
        if !inbox.notified {
            // Non-blocking; one byte outstanding per drain, so the buffer never fills. A write that
            // fails leaves `notified` false: the next push tries again.
            inbox.notified = loop {
                match (&self.wake).write(&[1]) {
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() != ErrorKind::WouldBlock => break false,
                    _ => break true,
                }
            };
        }
    }

    /// Ends stream `id` for both sides (with `status`, if any); false when it was not open.
    fn end(&self, id: u64, status: Option<Status>) -> bool {
        let open = self.streams.lock().unwrap().remove(&id);
        open.map(|o| o.end(status)).is_some()
    }
}

/// gRPC messages as the bytes they are: Python parses them.
#[derive(Clone, Copy, Default)]
struct Raw;

impl Codec for Raw {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl Encoder for Raw {
    type Item = Bytes;
    type Error = Status;
    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Bytes;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// One Process stream's answers; dropped before Python finished it (the client went away), it tells
/// Python the stream is reset.
struct Answers {
    id: u64,
    rx: mpsc::UnboundedReceiver<Answer>,
    unread: Arc<AtomicUsize>,
    shared: Arc<Shared>,
}

impl tokio_stream::Stream for Answers {
    type Item = Answer;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Answer>> {
        let next = self.rx.poll_recv(cx);
        if let Poll::Ready(Some(Ok(answer))) = &next {
            self.unread.fetch_sub(answer.len(), Ordering::Relaxed);
        }
        next
    }
}

impl Drop for Answers {
    fn drop(&mut self) {
        if self.shared.end(self.id, None) {
            self.shared.push(self.id, RESET, None);
        }
    }
}

struct ProcessSvc(Arc<Shared>);

impl StreamingService<Bytes> for ProcessSvc {
    type Response = Bytes;
    type ResponseStream = Answers;
    type Future = std::future::Ready<Result<Response<Answers>, Status>>;

    fn call(&mut self, request: Request<Streaming<Bytes>>) -> Self::Future {
        let shared = self.0.clone();
        let id = shared.next.fetch_add(1, Ordering::Relaxed);
        let (answers, rx) = mpsc::unbounded_channel();
        let credit = Arc::new(Semaphore::new(shared.max_message.min(Semaphore::MAX_PERMITS)));
        let over = Arc::new(Notify::new());
        let unread = Arc::new(AtomicUsize::new(0));
        let open = Open {
            answers,
            credit: credit.clone(),
            over: over.clone(),
            unread: unread.clone(),
        };
        shared.streams.lock().unwrap().insert(id, open);
        shared.push(id, OPENED, None);
        let inbound = request.into_inner();
        tokio::spawn(read(shared.clone(), id, inbound, credit, over));
        std::future::ready(Ok(Response::new(Answers { id, rx, unread, shared })))
    }
}

/// Stream `id`'s messages into the inbox, each once the stream has credit for it, until the client
/// ends its side, the stream fails, or Python is done with it.
async fn read(shared: Arc<Shared>, id: u64, mut inbound: Streaming<Bytes>, credit: Arc<Semaphore>, over: Arc<Notify>) {
    loop {
        let next = tokio::select! {
            next = inbound.message() => next,
            _ = over.notified() => return,
        };
        match next {
            Ok(Some(m)) => {
                let size = u32::try_from(m.len().max(1)).unwrap_or(u32::MAX);
                let granted = tokio::select! {
                    granted = credit.acquire_many(size) => granted,
                    _ = over.notified() => return,
                };
                match granted {
                    Ok(permit) => permit.forget(), // returned by `consumed`
                    Err(_) => return,              // the stream ended meanwhile
                }
                shared.push(id, MESSAGE, Some(m));
            }
            Ok(None) => return shared.push(id, ENDED, None),
            Err(status) => {
                // A message over the cap, or the client gone: the stream ends with the error.
                if shared.end(id, Some(status)) {
                    shared.push(id, RESET, None);
                }
                return;
            }
        }
    }
}

struct CheckSvc(Arc<Shared>);

/// A health check's entry, removed however its call ends.
struct Forget(Arc<Shared>, u64);

impl Drop for Forget {
    fn drop(&mut self) {
        self.0.checks.lock().unwrap().remove(&self.1);
    }
}

impl UnaryService<Bytes> for CheckSvc {
    type Response = Bytes;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Bytes>, Status>> + Send>>;

    fn call(&mut self, request: Request<Bytes>) -> Self::Future {
        let shared = self.0.clone();
        Box::pin(async move {
            let id = shared.next.fetch_add(1, Ordering::Relaxed);
            let (tx, rx) = oneshot::channel();
            shared.checks.lock().unwrap().insert(id, tx);
            let _forget = Forget(shared.clone(), id); // also when the client gives up first
            shared.push(id, CHECK_ASKED, Some(request.into_inner()));
            match tokio::time::timeout(CHECK_TIMEOUT, rx).await {
                Ok(Ok(answer)) => answer.map(Response::new),
                _ => Err(Status::unavailable("the picker did not answer")),
            }
        })
    }
}

#[derive(Clone)]
struct Svc {
    shared: Arc<Shared>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = Result<T, Infallible>> + Send>>;

impl<B> tower_service::Service<http::Request<B>> for Svc
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let shared = self.shared.clone();
        let max = Some(shared.max_message);
        match req.uri().path() {
            PROCESS if shared.process => Box::pin(async move {
                let mut grpc = Grpc::new(Raw).apply_max_message_size_config(max, max);
                Ok(grpc.streaming(ProcessSvc(shared), req).await)
            }),
            CHECK => Box::pin(async move {
                let mut grpc = Grpc::new(Raw);
                Ok(grpc.unary(CheckSvc(shared), req).await)
            }),
            _ => Box::pin(async move {
                // Read what the client sends first (bounded): a gRPC client still sending takes an
                // early answer as a failed send, not as the status.
                let mut body = Box::pin(req.into_body());
                let _ = tokio::time::timeout(UNSERVED_READ, async {
                    while let Some(Ok(_)) = body.frame().await {} // read and dropped
                })
                .await;
                Ok(Status::unimplemented("not served here").into_http())
            }),
        }
    }
}

/// The picker's gRPC server (`routerfleet_index.ExtProcServer`), serving on its own thread.
#[pyclass(name = "ExtProcServer", frozen)]
pub struct PyExtProcServer {
    shared: Arc<Shared>,
    wakeup: UnixStream,
    port: u16,
    lifetime: Mutex<Lifetime>,
}

/// What stops the server: a graceful shutdown, an abort, and the thread to join.
struct Lifetime {
    graceful: Option<oneshot::Sender<()>>,
    abort: Option<oneshot::Sender<()>>,
    done: Option<std::sync::mpsc::Receiver<()>>,
    thread: Option<JoinHandle<()>>,
}

/// The longest connection age taken (a day); longer is a mistake, not a setting.
const MAX_CONNECTION_AGE_S: f64 = 86_400.0;
/// HTTP/2 flow-control windows: a stream's, and a connection's (room for 64 stalled streams).
const STREAM_WINDOW: u32 = 1 << 20;
const CONNECTION_WINDOW: u32 = 64 << 20;
/// A client that has not finished its TLS handshake in this long is dropped.
const TLS_HANDSHAKE: Duration = Duration::from_secs(10);

/// Bound on every address `host` names (as the proxy's port is: `localhost` may be 127.0.0.1 and ::1),
/// all on one port: the first's, when `port` is 0.
fn bind(host: &str, port: u16) -> PyResult<Vec<StdListener>> {
    let addresses: Vec<_> = (host, port)
        .to_socket_addrs()
        .map_err(|e| PyOSError::new_err(format!("picker address {host}:{port}: {e}")))?
        .collect();
    bind_all(&addresses).map_err(|e| PyOSError::new_err(format!("picker port {host}:{port}: {e}")))
}

fn bind_all(addresses: &[SocketAddr]) -> std::io::Result<Vec<StdListener>> {
    let mut listeners: Vec<StdListener> = Vec::new();
    for address in addresses {
        let mut address = *address;
        if let Some(first) = listeners.first() {
            address.set_port(first.local_addr()?.port());
        }
        if listeners.iter().any(|l| l.local_addr().ok() == Some(address)) {
            continue; // named twice
        }
        let listener = StdListener::bind(address)?;
        listener.set_nonblocking(true)?;
        listeners.push(listener);
    }
    if listeners.is_empty() {
        return Err(std::io::Error::new(ErrorKind::AddrNotAvailable, "no address to bind"));
    }
    Ok(listeners)
}

/// How long accepting pauses after an error that is not the client's (out of file descriptors, of
/// memory): retrying at once would spin a core until descriptors free up.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// How long a closing connection reads out what its client still sends.
const LINGER: Duration = Duration::from_secs(1);

/// A connection that, as the server closes it, first reads out what its client still sends (its flow
/// control updates, its acknowledgements) until the client closes too, for up to LINGER: a socket
/// closed with unread bytes is reset, and the reset can destroy answers its client has not yet read.
struct Lingering {
    io: TcpStream,
    closed: bool,
    linger: Option<Pin<Box<Sleep>>>,
}

impl Connected for Lingering {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.io.connect_info()
    }
}

impl AsyncRead for Lingering {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Lingering {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if !self.closed {
            std::task::ready!(Pin::new(&mut self.io).poll_shutdown(cx))?; // our side ends: the client reads to the end
            self.closed = true;
        }
        let this = &mut *self;
        let linger = this.linger.get_or_insert_with(|| Box::pin(tokio::time::sleep(LINGER)));
        let mut sink = [0u8; 4096];
        loop {
            if linger.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Ok(()));
            }
            let mut read = ReadBuf::new(&mut sink);
            match Pin::new(&mut this.io).poll_read(cx, &mut read) {
                Poll::Ready(Ok(())) if !read.filled().is_empty() => continue,
                Poll::Ready(_) => return Poll::Ready(Ok(())), // the client closed (or failed): done
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// Accepts connections into `tx` until its receiver is gone (the server stopped taking connections:
/// the listener closes then).
async fn accept_into(listener: TcpListener, tx: mpsc::Sender<std::io::Result<Lingering>>) {
    loop {
        let accepted = tokio::select! {
            _ = tx.closed() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, _)) => {
                let _ = stream.set_nodelay(true);
                let stream = Lingering {
                    io: stream,
                    closed: false,
                    linger: None,
                };
                if tx.send(Ok(stream)).await.is_err() {
                    return;
                }
            }
            // The connection's own failure: the next one may be fine.
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset) => {}
            Err(_) => tokio::time::sleep(ACCEPT_BACKOFF).await,
        }
    }
}

/// The transport's thread asks the kernel not to run it the moment it is woken (SCHED_BATCH: no
/// wakeup preemption). Each answer Python hands over wakes this thread; where the two share a core,
/// the event loop was otherwise switched out mid-drain at every answer and back (bench/README.md, the
/// endpoint picker's path, set 8: what that cost). Now the answers go out when the loop waits, or at
/// once from another core. Best effort: refused, the thread runs as any other. Linux only (pid 0 is
/// the calling thread there); the raw syscall, since musl's wrapper refuses by design.
#[cfg(target_os = "linux")]
fn batch_scheduling() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: the syscall reads a valid, initialized sched_param and changes only this thread.
    unsafe {
        libc::syscall(
            libc::SYS_sched_setscheduler,
            0,
            libc::SCHED_BATCH,
            &param as *const libc::sched_param,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn batch_scheduling() {}

#[pymethods]
impl PyExtProcServer {
    /// Bound now (an address in use fails here), serving from the start: `tls` a (cert, key) PEM
    /// pair or None for plaintext; `process` false serves health alone (a kubelet's plaintext probe).
    #[new]
    #[pyo3(signature = (host, port, *, tls, max_message, connection_age_s, keepalive_s, process))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        host: &str,
        port: u16,
        tls: Option<(Vec<u8>, Vec<u8>)>,
        max_message: usize,
        connection_age_s: f64,
        keepalive_s: f64,
        process: bool,
    ) -> PyResult<Self> {
        if !(connection_age_s > 0.0 && connection_age_s <= MAX_CONNECTION_AGE_S) {
            return Err(PyValueError::new_err("connection_age_s: more than 0, at most a day"));
        }
        if !(keepalive_s > 0.0 && keepalive_s <= MAX_CONNECTION_AGE_S) {
            return Err(PyValueError::new_err("keepalive_s: more than 0, at most a day"));
        }
        if max_message == 0 {
            return Err(PyValueError::new_err("max_message must be positive"));
        }
        let listeners = bind(host, port)?;
        let bound = listeners[0].local_addr()?.port();
        // A stream waiting for credit stops reading: its unread bytes hold its own window, not the
        // connection's, so other streams on the connection go on.
        // A peer gone without a FIN (a node lost, a partition) is found by pings: unanswered, its
        // connection closes and its streams reset, so what they hold goes back (a GOAWAY alone waits for
        // them without end).
        let keepalive = Duration::from_secs_f64(keepalive_s);
        let mut builder = Server::builder()
            .max_connection_age(Duration::from_secs_f64(connection_age_s))
            .http2_keepalive_interval(Some(keepalive))
            .http2_keepalive_timeout(Some(keepalive))
            .initial_stream_window_size(STREAM_WINDOW)
            .initial_connection_window_size(CONNECTION_WINDOW);
        if let Some((cert, key)) = tls {
            let config = ServerTlsConfig::new()
                .identity(Identity::from_pem(cert, key))
                .timeout(TLS_HANDSHAKE);
            builder = builder
                .tls_config(config)
                .map_err(|e| PyValueError::new_err(format!("the picker's TLS certificate: {e}")))?;
        }
        let (wake, wakeup) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        wakeup.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            inbox: Mutex::new(Inbox {
                events: VecDeque::new(),
                notified: false,
            }),
            wake,
            streams: Mutex::new(HashMap::new()),
            checks: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            process,
            max_message,
        });
        let svc = Svc { shared: shared.clone() };
        let (graceful, graceful_rx) = oneshot::channel::<()>();
        let (abort, abort_rx) = oneshot::channel::<()>();
        let (done_tx, done) = std::sync::mpsc::channel::<()>();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let incoming = {
            let _entered = runtime.enter();
            let (tx, rx) = mpsc::channel(1);
            for listener in listeners {
                runtime.spawn(accept_into(TcpListener::from_std(listener)?, tx.clone()));
            }
            ReceiverStream::new(rx)
        };
        let thread = std::thread::Builder::new()
            .name("routerfleet-epp".into())
            .spawn(move || {
                let _done = done_tx; // dropped as the thread ends: `close` stops waiting
                batch_scheduling();
                runtime.block_on(async move {
                    // Either sender dropped (the object gone without close) stops the server too.
                    let serving = builder.serve_with_incoming_shutdown(svc, incoming, async {
                        let _ = graceful_rx.await;
                    });
                    tokio::select! {
                        _ = serving => {}
                        _ = abort_rx => {} // dropping the server drops its connections
                    }
                });
                runtime.shutdown_timeout(Duration::from_secs(1));
            })?;
        Ok(PyExtProcServer {
            shared,
            wakeup,
            port: bound,
            lifetime: Mutex::new(Lifetime {
                graceful: Some(graceful),
                abort: Some(abort),
                done: Some(done),
                thread: Some(thread),
            }),
        })
    }

    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// The socket to watch for readability: something is in the inbox.
    fn fileno(&self) -> i32 {
        self.wakeup.as_raw_fd()
    }

    /// Everything in the inbox, oldest first: a list of (id, kind, payload bytes or None).
    fn drain<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let mut sink = [0u8; 64];
        loop {
            match (&self.wakeup).read(&mut sink) {
                Ok(n) if n > 0 => continue,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                _ => break,
            }
        }
        let events = {
            let mut inbox = self.shared.inbox.lock().unwrap();
            inbox.notified = false;
            std::mem::take(&mut inbox.events)
        };
        let out = PyList::empty(py);
        for (id, kind, payload) in events {
            let payload = match payload {
                Some(b) => PyBytes::new(py, &b).into_any(),
                None => py.None().into_bound(py),
            };
            let id = id.into_pyobject(py)?.into_any();
            let kind = kind.into_pyobject(py)?.into_any();
            out.append(PyTuple::new(py, [id, kind, payload])?)?;
        }
        Ok(out)
    }

    /// Python has taken `size` bytes of stream `id`'s messages off its queue: the reader may read on.
    fn consumed(&self, id: u64, size: usize) {
        if let Some(open) = self.shared.streams.lock().unwrap().get(&id) {
            open.credit.add_permits(size.max(1));
        }
    }

    /// One answer on stream (or health check) `id`; false when it is gone.
    fn send(&self, id: u64, data: &[u8]) -> bool {
        let streams = self.shared.streams.lock().unwrap();
        if let Some(open) = streams.get(&id) {
            let unread = open.unread.fetch_add(data.len(), Ordering::Relaxed) + data.len();
            if unread <= UNREAD_CAPS * self.shared.max_message {
                return open.answers.send(Ok(Bytes::copy_from_slice(data))).is_ok();
            }
            drop(streams);
            let status = Status::resource_exhausted("the client does not read its answers");
            if self.shared.end(id, Some(status)) {
                self.shared.push(id, RESET, None);
            }
            return false;
        }
        drop(streams);
        if let Some(tx) = self.shared.checks.lock().unwrap().remove(&id) {
            return tx.send(Ok(Bytes::copy_from_slice(data))).is_ok();
        }
        false
    }

    /// Ends `id`: OK after its answers (`code` 0), else with that gRPC status code and message.
    fn finish(&self, id: u64, code: i32, message: &str) {
        let status = (code != 0).then(|| Status::new(Code::from_i32(code), message));
        if !self.shared.end(id, status.clone()) {
            if let Some(tx) = self.shared.checks.lock().unwrap().remove(&id) {
                let _ = tx.send(Err(status.unwrap_or_else(|| Status::internal("no answer"))));
            }
        }
    }

    /// Streams open (not yet finished by Python, nor reset).
    fn open_streams(&self) -> usize {
        self.shared.streams.lock().unwrap().len()
    }

    /// Stop taking connections and streams; the open ones go on until they end or `close`.
    fn shutdown(&self) {
        if let Some(graceful) = self.lifetime.lock().unwrap().graceful.take() {
            let _ = graceful.send(());
        }
    }

    /// Ends what is still open (UNAVAILABLE), lets the connections close on their own for up to
    /// `grace_s` seconds (answers already sent still reach their clients), then drops them and joins
    /// the server's thread (its runtime gets 1 s more).
    fn close(&self, py: Python<'_>, grace_s: f64) {
        let mut lifetime = self.lifetime.lock().unwrap();
        if let Some(graceful) = lifetime.graceful.take() {
            let _ = graceful.send(());
        }
        let open: Vec<Open> = self.shared.streams.lock().unwrap().drain().map(|(_, o)| o).collect();
        for o in open {
            o.end(Some(Status::unavailable("the endpoint picker is stopping")));
        }
        self.shared.checks.lock().unwrap().clear();
        let (done, abort, thread) = (lifetime.done.take(), lifetime.abort.take(), lifetime.thread.take());
        drop(lifetime);
        py.detach(move || {
            if let Some(done) = done {
                let grace_s = if grace_s.is_nan() {
                    0.0
                } else {
                    grace_s.clamp(0.0, MAX_CONNECTION_AGE_S)
                };
                let grace = Duration::from_secs_f64(grace_s);
                let _ = done.recv_timeout(grace);
            }
            if let Some(abort) = abort {
                let _ = abort.send(());
            }
            if let Some(thread) = thread {
                let _ = thread.join();
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_address_is_bound_on_one_port() {
        let addresses: Vec<SocketAddr> = vec!["127.0.0.1:0".parse().unwrap(), "[::1]:0".parse().unwrap()];
        let listeners = bind_all(&addresses).unwrap();
        let bound: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        assert_eq!(bound.len(), 2);
        assert_eq!(bound[0].port(), bound[1].port());
        assert!(bound[0].is_ipv4() && bound[1].is_ipv6());
        let twice = bind_all(&[addresses[0], addresses[0]]).unwrap();
        assert_eq!(twice.len(), 1);
    }
}
