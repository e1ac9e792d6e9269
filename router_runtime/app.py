"""The router process: the KV plane, the routing policy and the request plane behind one HTTP surface.

The public port: the inference API (the proxy, see ``proxy/server.py``), ``/healthz`` and ``/readyz``.
The metrics port: ``/metrics``, ``/debug/index``, ``/debug/load``. The internal port (siblings and the
operator, with the fleet token): ``bootstrap/http.py``. The endpoint picker (gRPC): ``gateway/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from . import __version__
from .bootstrap.fetch import SnapshotFetcher
from .bootstrap.http import internal_app, read_token
from .bootstrap.metrics import BootstrapMetrics
from .bootstrap.peers import Peer, PeerRegistry, peers_of
from .bootstrap.producer import SnapshotProducer
from .bootstrap.state import Cause, CauseCode, RankState
from .bootstrap.sweep import Bootstrapper
from .bootstrap.vetting import HashingConfig
from .config import RouterConfig
from .disaggregation.metrics import PdMetrics
from .disaggregation.prefill import RemotePrefill
from .discovery.endpointslices import EngineDiscoveryConfig, port_ref
from .discovery.kubernetes import EndpointSliceWatcher, InferencePoolWatcher
from .discovery.served_models import ServedModels
from .fleet.board import LoadBoard
from .fleet.engine_metrics import EngineLoadScraper
from .fleet.flush import FlushResult, flush
from .fleet.gossip import LoadGossip, PeerReport, ReportOutcome
from .fleet.inflight import LoadTracker
from .fleet.metrics import FleetMetrics
from .fleet.notices import KvNotice, NoticeKind, Notices
from .fleet.view import EngineSample
from .gateway.objectives import Objectives
from .gateway.picker import EndpointPicker
from .gateway.tls import server_identity
from .gateway.transport import PickerServer, serve, serve_health
from .kv.hashing import SCHEME, hash_set_digest
from .kv.index import TIER_ORDER
from .kv.plane import KVPlane
from .kv.withhold import WithholdReason
from .proxy import log_redaction
from .proxy.audit import PredictionAudit
from .proxy.debug import DebugPrediction
from .proxy.drain import Drain
from .proxy.endpoints import FORWARDED, RESPONSE_ITEM
from .proxy.errors import ProxyError, openai_errors
from .proxy.health import AnswerProvesUp, BreakerState, HealthBoard, HealthChecker
from .proxy.metrics import ProxyMetrics
from .proxy.responses import ResponseRouter
from .proxy.scheduler import Scheduler
from .proxy.server import Proxy
from .proxy.serving import GuardedRunner
from .proxy.targets import TargetBook
from .scheduling.admission import Admission
from .scheduling.framework import Profile
from .scheduling.hooks import RequestHook
from .scheduling.inflight_prefix import in_one_report
from .scheduling.presets import make_policy
from .scheduling.types import Shared
from .sessions.affinity import RememberSession, SessionAffinity
from .sessions.bindings import BindingMetrics, BindResponseId, ResponseBindings
from .sessions.metrics import SessionMetrics
from .sessions.redis_store import SharedClient
from .sessions.snapshot import from_wire, to_wire
from .tasks import end_tasks
from .tokens.engine import EngineTokenizer
from .tokens.tokenizer import ENGINE_TOKENIZER, AsyncTokenizer, Tokenizer, load_tokenizer
from .tracing.export import OtlpExporter, TraceMetrics
from .tracing.spans import OFF, Tracer
from .worker import Carrier, Role, WorkerSpec

log = logging.getLogger(__name__)


METRICS_PAGES = ("/metrics", "/debug/index", "/debug/load")  # the metrics port's pages
PROBES = ("/healthz", "/readyz")  # the kubelet's, not clients'


class Router:
    def __init__(
        self,
        config: RouterConfig,
        *,
        policy: Profile | None = None,
        tokenizer: Tokenizer | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.internal_url: str | None = None
        self.metrics_url: str | None = None  # the metrics port's base URL, once it listens
        self.epp_address: str | None = None  # host:port of the gateway's endpoint picker, when served
        self.epp_server: PickerServer | None = None
        self.epp_health_address: str | None = None  # its plaintext gRPC health (--epp-health-port)
        self.registry = CollectorRegistry()
        # Who this replica is to its siblings (snapshot producer, load reports).
        self.replica_id = os.environ.get("POD_NAME") or f"router-{os.getpid()}"
        # Unique per process even where ids repeat (pid 1 in every container, replicas in one test).
        self.incarnation = f"{os.getpid()}-{int(time.time() * 1000)}-{secrets.token_hex(4)}"
        self.drained: Drain | None = None  # set by drain() on SIGTERM
        # The fleet token: the internal port's, the siblings', and the debug prediction's credential.
        self.token = read_token(config.internal.token_file) if config.internal.token_file else None
        self.kv = KVPlane(config.kv, self.registry)
        self.policy = (
            policy if policy is not None else make_policy(config.scheduling.policy, config.scheduling.tuning)
        )
        self.metrics = ProxyMetrics(self.registry)
        self.health = HealthBoard(
            config.health.breaker,
            clock=clock,
            on_transition=self._breaker_moved,
        )
        # The fleet-shared store (Redis), when configured: sessions and response bindings, each table
        # backed by this replica's own (docs/sessions.md).
        self.shared_store = self._shared_store(config)
        shared = self.shared_store
        self.sessions = SessionAffinity(
            config.sessions,
            SessionMetrics(self.registry),
            shared.table("sessions", config.sessions.ttl_s) if shared is not None else None,
            evicted_at=lambda: self.kv.writer.evicted_at,
        )
        self.bindings = ResponseBindings(
            config.responses,
            BindingMetrics(self.registry),
            incarnations=lambda: self.sessions.incarnations,
            shared=shared.table("responses", config.responses.ttl_s) if shared is not None else None,
        )
        # KV policies target (engine, rank); the others whole engines.
        self.targets = TargetBook(self.health, per_rank=bool(self.policy.needs_tokens))
        self._setup_fleet_load(config, clock)
        self.executor = ThreadPoolExecutor(
            max_workers=config.tokens.threads or min(4, os.cpu_count() or 1), thread_name_prefix="tokenize"
        )
        # The pool's InferenceObjectives (their priorities make requests sheddable), when a pool is named.
        self.objectives: Objectives | None = None
        if config.gateway.pool:
            d = config.discovery
            self.objectives = Objectives(
                d.watched_namespace(),
                config.gateway.pool,
                self.registry,
                kubeconfig=d.kubeconfig,
                watch_timeout_s=d.watch_timeout_s,
            )
        # Request traces to a collector (tracing/), when an endpoint is set; else no tracer runs.
        self.trace_exporter: OtlpExporter | None = None
        self.tracer = OFF
        if config.tracing.enabled:
            self.trace_exporter = OtlpExporter(config.tracing, TraceMetrics(self.registry), __version__)
            self.tracer = Tracer(config.tracing, self.trace_exporter.submit)
        self._setup_request_plane(config, tokenizer)
        self.checker = HealthChecker(
            self.health,
            lambda: self.proxy.session,
            lambda: self.targets.urls,
            interval_s=config.health.interval_s,
            timeout_s=config.health.timeout_s,
        )
        self._checker_task: asyncio.Task | None = None
        self._setup_bootstrap(config)
        self._setup_discovery(config)

    def _setup_discovery(self, config: RouterConfig) -> None:
        """Kubernetes discovery (else ``config.workers``): an InferencePool's pods or the engines'
        EndpointSlices, and with a peer selector the siblings' slices."""
        self.engine_watcher: EndpointSliceWatcher | InferencePoolWatcher | None = None
        self.prefill_watcher: EndpointSliceWatcher | None = None
        self.peer_watcher: EndpointSliceWatcher | None = None
        self._by_role: dict[Role, list[WorkerSpec]] = {}
        d = config.discovery
        if d.pool:
            self.engine_watcher = InferencePoolWatcher(
                d.watched_namespace(),
                d.pool,
                self.set_workers,
                config=d.engines(),
                kubeconfig=d.kubeconfig,
                registry=self.registry,
                watch_timeout_s=d.watch_timeout_s,
                revision_label=d.revision_label,
                role_label=d.role_label,
            )
        elif d.selector:
            self.engine_watcher = EndpointSliceWatcher(
                d.watched_namespace(),
                d.selector,
                self._role_changed(Role.DECODE) if d.prefill_selector else self.set_workers,
                config=d.engines(),
                kubeconfig=d.kubeconfig,
                registry=self.registry,
                watch_timeout_s=d.watch_timeout_s,
                storage_annotation=d.storage_annotation or None,
                revision_label=d.revision_label if d.disaggregated else None,
                role_label=d.role_label,
            )
        if d.prefill_selector and self.engine_watcher is not None:
            self.prefill_watcher = EndpointSliceWatcher(
                d.watched_namespace(),
                d.prefill_selector,
                self._role_changed(Role.PREFILL),
                config=d.engines(),
                kubeconfig=d.kubeconfig,
                registry=CollectorRegistry(),  # its own: its discovery metrics would collide
                watch_timeout_s=d.watch_timeout_s,
                storage_annotation=d.storage_annotation or None,
                revision_label=d.revision_label,
            )
        if self.engine_watcher is not None and config.peers.selector:
            # The routers' own peer Service: only ready siblings are listed, so a booting replica
            # never seeds another booting one.
            self.peer_watcher = EndpointSliceWatcher(
                d.watched_namespace(),
                config.peers.selector,
                self._peers_changed,
                config=EngineDiscoveryConfig(http_port=port_ref(config.peers.port)),
                kubeconfig=d.kubeconfig,
                # its own registry: its discovery metrics would collide with the engines'
                registry=CollectorRegistry(),
                watch_timeout_s=d.watch_timeout_s,
            )

    def _role_changed(self, role: Role) -> Callable[[list[WorkerSpec]], None]:
        """A disaggregated fleet's watcher of one role: the worker set is both watchers' engines, each
        with its role, published once both have synced (until then, a fleet of one role would route
        as if the other did not exist)."""

        def changed(workers: list[WorkerSpec]) -> None:
            self._by_role[role] = [dataclasses.replace(w, role=role) for w in workers]
            if len(self._by_role) == 2:
                self.set_workers([w for ws in self._by_role.values() for w in ws])

        return changed

    def _breaker_moved(self, engine: str, state: BreakerState) -> None:
        """An engine failing health hides its KV carriers (DISCONNECTED); passing again shows them."""
        self.metrics.breaker_transitions.labels(state).inc()
        if state is BreakerState.OPEN:
            self.kv.engine_unreachable(engine)
        elif state is BreakerState.CLOSED:
            self.kv.engine_reachable(engine)

    def _setup_bootstrap(self, config: RouterConfig) -> None:
        """The producer serves our index to siblings; the bootstrapper pulls theirs. Both need the
        internal port's token; both need an index, which only the KV-aware policy keeps."""
        self.hashing = HashingConfig(config.kv.block_size, SCHEME)
        keeps_index = bool(self.policy.needs_tokens)
        registry = PeerRegistry(self_name=os.environ.get("POD_NAME"), self_ip=os.environ.get("POD_IP"))
        peers = config.peers
        if peers.selector and not (registry.self_name or registry.self_ip):
            log.warning("neither POD_NAME nor POD_IP is set: this replica may list itself as a peer")
        if peers.urls:
            registry.publish([Peer(u.rstrip("/"), u.rstrip("/")) for u in peers.urls])
        if not (peers.selector or peers.urls):
            registry.publish([])  # synced and alone: a rank the origin replay cannot rebuild runs cold
        # Origin needs nothing but the engines' replay sockets; peers also need the internal token.
        self.bootstrap_metrics = BootstrapMetrics(self.registry)
        self.bootstrap = Bootstrapper(
            self.kv,
            registry,
            SnapshotFetcher(self.token or ""),
            self.hashing,
            self.bootstrap_metrics,
            dataclasses.replace(config.bootstrap, enabled=keeps_index and config.bootstrap.enabled),
            # A booting replica inherits its sibling's session table with the graft (vetted: entries
            # naming engines or incarnations we do not know are dropped).
            on_sessions=lambda entries: self.sessions.inherit(from_wire(entries)),
            on_responses=lambda entries: self.bindings.inherit(from_wire(entries)),
            blocker=self.blocker,
        )
        self.producer = (
            SnapshotProducer(
                self.kv,
                self.hashing,
                producer_id=self.replica_id,
                producer_incarnation=self.incarnation,
                ready=lambda: self.bootstrap.settled,
                # A DISCONNECTED carrier is exported neither as blocks nor as a cursor.
                include=lambda c: self.bootstrap.exportable(c) and self.kv.index.visible_tiers(c) != 0,
                sessions=lambda: to_wire(self.sessions.export()),
                responses=lambda: to_wire(self.bindings.export()),
            )
            if self.token and keeps_index
            else None
        )

    def _setup_request_plane(self, config: RouterConfig, tokenizer: Tokenizer | None) -> None:
        """The scheduler (its shell: pin, session, tokens) and the proxy that runs it, with its hooks."""
        self.tokenizer = self._tokenizer(tokenizer)
        self.served_models: ServedModels | None = None
        if config.proxy.served_models_interval_s > 0:
            interval = config.proxy.served_models_interval_s
            self.served_models = ServedModels(lambda: self.targets.urls, interval)
        self.scheduler = Scheduler(
            self.policy,
            tokenizer=self.tokenizer,
            metrics=self.metrics,
            loads=self.fleet.view,
            index_fn=lambda: self.kv.index,
            sessions=self.sessions,
            # Where a stored Responses API response lives (a request naming one must go there); its
            # probes ride the proxy's connection pool.
            responses=ResponseRouter(self.bindings, lambda: self.proxy.session),
            doubt_fn=self.doubtful,
            admission=self._admission(config),
            describe_load=self.fleet.describe,
            adapters=lambda: self.served_models.adapters if self.served_models is not None else frozenset(),
            credit_watches=self.kv.writer,
        )
        self.proxy = Proxy(
            scheduler=self.scheduler,
            targets=self.targets,
            health=self.health,
            load=self.load,
            metrics=self.metrics,
            config=config.proxy,
            executor=self.executor,
            strip_headers=self.sessions.strip,
            limits=config.server,
            hooks=self._request_hooks(config),
            tracer=self.tracer,
        )
        # Used only while discovery finds prefill engines (docs/disaggregation.md).
        self.proxy.prefill = RemotePrefill(
            config.disaggregation,
            profile=make_policy(config.scheduling.policy, config.scheduling.tuning),
            targets=self.targets,
            loads=self.fleet.view,
            health=self.health,
            metrics=PdMetrics(self.registry),
            session=lambda: self.proxy.session,
            acquire=self.proxy.acquire,
            release=self.proxy.release,
        )

    def _admission(self, config: RouterConfig) -> Admission | None:
        """Sheddable requests turned away while no engine has room (scheduling/admission.py): only
        with the pool's objectives to say which are sheddable."""
        if self.objectives is None:
            return None
        limits = config.gateway.saturation
        return Admission(self.objectives.priority, lambda targets: self.fleet.saturated(targets, limits))

    def _request_hooks(self, config: RouterConfig) -> list[RequestHook]:
        """What runs around each dispatch (scheduling/hooks.py), in order: the breakers, the session's
        memory, the prediction's debug headers (only when enabled), the audit, response-id binding."""
        hooks: list[RequestHook] = [AnswerProvesUp(self.health), RememberSession(self.sessions)]
        if config.proxy.debug_prediction and self.token:
            hooks.append(DebugPrediction(self.token))
        deny = self.engine_denied if config.proxy.audit_withhold else None
        hooks.append(PredictionAudit(self.metrics, self.policy.name, expect=self.kv.expect_batch, deny=deny))
        hooks.append(BindResponseId(self.bindings))
        return hooks

    def _setup_fleet_load(self, config: RouterConfig, clock: Callable[[], float]) -> None:
        """This replica's in-flight load, siblings' reports (sent to the peers bootstrap discovers, so the
        fleet needs nothing more to configure) and the engines' own metrics make ``self.fleet``; see
        docs/fleet-load.md."""
        peer_urls = lambda: [p.url for p in self.bootstrap.peers.peers]  # noqa: E731
        self.fleet_metrics = FleetMetrics(self.registry)
        self.gossip: LoadGossip | None = None
        if self.token and config.fleet.gossip.window_s > 0:
            self.gossip = LoadGossip(
                self.token,
                peer_urls,
                lambda: self.fleet.report(self._shared()),
                config.fleet.gossip,
                on_sent=lambda outcome: self.fleet_metrics.sends.labels(outcome).inc(),
            )
        self.load = LoadTracker(on_change=self.gossip.changed.set if self.gossip is not None else None)
        self.fleet = LoadBoard(
            self.load,
            lambda: tuple(self.targets.all_targets()),
            replica=self.replica_id,
            incarnation=self.incarnation,
            bounds=config.fleet.bounds,
            clock=clock,
        )
        # KV notices (withheld ranks, flushes) go to the same peers (fleet/notices.py).
        self.notices = Notices(self.token, peer_urls) if self.token else None
        self.scraper: EngineLoadScraper | None = None
        if config.fleet.scrape.interval_s > 0:
            self.scraper = EngineLoadScraper(
                lambda: self.targets.urls,
                self.fleet.engine_read_started,
                self._engine_read,
                config.fleet.scrape,
                clock=self.fleet.clock,  # samples are aged on the board's clock
            )
        self._fleet_tasks: list[asyncio.Task] = []

    def _engine_read(self, engine: str, sample: EngineSample | None, outcome: str) -> None:
        self.fleet_metrics.engine_reads.labels(outcome).inc()
        self.fleet.engine_read(engine, sample)
        if sample is not None:
            self.policy.adapters_read(engine, sample.adapters)

    def _profiles(self, *, deciding: bool = True) -> tuple[Profile, ...]:
        """The profiles that decide here (``deciding`` False: that may hold state): the policy's, and
        the prefill profile while the fleet is disaggregated (its remote prefills:
        disaggregation/prefill.py)."""
        prefill = self.proxy.prefill
        if prefill is None or (deciding and not self.targets.disaggregated):
            return (self.policy,)
        return (prefill.profile, self.policy)

    def _shared(self) -> Shared:
        """What this replica's profiles tell its siblings with each load report: the prefill profile's
        predictions first (one per remote prefill in flight: fewer than the decode side's)."""
        profiles = self._profiles()
        if len(profiles) == 1:
            return self.policy.shared()
        return in_one_report(*(p.shared() for p in profiles))

    def accept_load_report(self, report: PeerReport | None) -> None:
        """A sibling's report off the internal port (None: it failed vetting)."""
        outcome = ReportOutcome.REJECTED if report is None else self.fleet.accept(report)
        self.fleet_metrics.reports.labels(outcome).inc()
        if report is not None and outcome is ReportOutcome.ACCEPTED:
            sender = (report.replica, report.incarnation)
            for profile in self._profiles():  # each counts the predictions on its own candidates
                profile.accept_peer(sender, report.shared, self.fleet.bounds.peer_max_age_s)

    def accept_notice(self, notice: KvNotice) -> None:
        """A sibling's KV notice off the internal port, vetted; ranks we do not follow are ignored."""
        # When the sibling's denied prediction was made, less what the notice may have spent in transit
        # (its engine's evidence reached both replicas at about the same time).
        since = time.monotonic() - notice.age_ms / 1000 - NOTICE_TRANSIT_S
        for c in notice.ranks:
            if self.kv.subscription(c) is None:
                continue
            if notice.kind is NoticeKind.FLUSHED:
                self.kv.withholds.flushed(c)
            elif notice.kind is NoticeKind.WITHHOLD_FLUSH:
                self.kv.withholds.withhold(c, WithholdReason.SIBLING_FLUSH)
            else:
                self.kv.withholds.withhold(c, WithholdReason.SIBLING_FALSE_HIT, since)

    async def flush_cache(self, engines: list[str] | None) -> FlushResult:
        """The fleet-wide flush (fleet/flush.py) of ``engines`` (ids; None: every engine). An engine this
        replica does not know is a LookupError naming it."""
        workers = self.kv.workers
        if engines is None:
            specs = list(workers.values())
        else:
            unknown = [e for e in engines if e not in workers]
            if unknown:
                raise LookupError(f"unknown engines: {', '.join(unknown[:8])}")
            specs = [workers[e] for e in dict.fromkeys(engines)]
        timeout_s = self.config.kv.withhold_s / 2  # the engines answer well inside the withhold's bound
        return await flush(self.kv, specs, self.proxy.session, self.notices, timeout_s)

    def _peers_changed(self, specs: list[WorkerSpec]) -> None:
        registry = self.bootstrap.peers
        registry.publish(peers_of(specs))
        self.bootstrap_metrics.peers.set(len(registry.peers))
        self.bootstrap_metrics.peers_synced.set(1)

    def _tokenizer(self, given: Tokenizer | None) -> AsyncTokenizer | EngineTokenizer:
        c = self.config.tokens
        if given is None and c.tokenizer == ENGINE_TOKENIZER:
            return EngineTokenizer(
                lambda: [u for e, u in self.targets.urls.items() if self.health.available(e)],
                c.chat_family,
                timeout_s=c.engine_timeout_s,
            )
        tok = given if given is not None else load_tokenizer(c.tokenizer, c.chat_family, c.chat_template)
        return AsyncTokenizer(tok, self.executor, c.inline_max_bytes)

    def _shared_store(self, config: RouterConfig) -> SharedClient | None:
        store = config.store
        if store.url is None:
            return None
        up = Gauge(
            "routerfleet_shared_store_up",
            "1 while the shared session store answers; 0 after a failure, until it answers again (the"
            " replica's own tables serve meanwhile)",
            registry=self.registry,
        )
        password = read_token(store.password_file) if store.password_file else None
        return SharedClient(store.url, password=password, on_state=lambda ok: up.set(1 if ok else 0))

    async def start(self) -> None:
        await self.kv.start()
        await self.proxy.start()
        if self.trace_exporter is not None:
            self.trace_exporter.start()
        self.bootstrap.start()
        if self.peer_watcher is not None:  # before the engines: a first rank consults the peer set
            await self.peer_watcher.start()
        if self.objectives is not None:
            await self.objectives.start()
        if self.engine_watcher is not None:
            await self.engine_watcher.start()
            if self.prefill_watcher is not None:
                await self.prefill_watcher.start()
        else:
            self.set_workers(list(self.config.workers))
        if self.config.health.interval_s > 0:
            self._checker_task = asyncio.create_task(self.checker.run(), name="engine-health")
        if self.gossip is not None:
            self._fleet_tasks.append(asyncio.create_task(self.gossip.run(), name="fleet-gossip"))
        if self.scraper is not None:
            self._fleet_tasks.append(asyncio.create_task(self.scraper.run(), name="engine-load"))
        if self.served_models is not None:
            self._fleet_tasks.append(asyncio.create_task(self.served_models.run(), name="served-models"))

    async def stop(self) -> None:
        """Every part stops, each bounded (``tasks.end_tasks``); the KV plane last, and whatever else
        fails or is cancelled, so its ZMQ context never outlives the router."""
        try:
            for watcher in (self.engine_watcher, self.prefill_watcher, self.peer_watcher, self.objectives):
                if watcher is not None:
                    await watcher.stop()
            await self.bootstrap.stop()
            await end_tasks([*self._fleet_tasks, self._checker_task], "router")
            self._fleet_tasks.clear()
            self._checker_task = None
            if self.notices is not None:
                await self.notices.close()
            await self.proxy.close()
            if self.trace_exporter is not None:  # after the servers: their last requests' traces too
                await self.trace_exporter.stop()
            if self.shared_store is not None:
                await self.bindings.close()
                await self.shared_store.close()
            if isinstance(self.tokenizer, EngineTokenizer):
                await self.tokenizer.close()
        finally:
            await self.kv.stop()
            self.executor.shutdown(wait=False, cancel_futures=True)

    def set_workers(self, specs: Iterable[WorkerSpec]) -> None:
        """The complete current worker set (static flags, or discovery): KV subscriptions, targets and
        breakers follow it. An engine that left takes its policy state (text trees) with it."""
        specs = list(specs)
        before = self.targets.all_targets()
        self.kv.set_workers(specs)
        if specs and not any(s.kv for s in specs):
            self.bootstrap.engines_without_events()  # else readiness would wait for a rank forever
        self.targets.set_workers(specs)
        self.sessions.set_workers(specs)
        after = self.targets.all_targets()
        for t in before - after:
            for profile in self._profiles(deciding=False):
                profile.remove_target(t)
        self.metrics.forget_engines({s.engine for s in specs} | set(self.load.engines()))
        self.fleet.forget_engines({s.engine for s in specs})

    def engine_denied(self, carrier: Carrier, since: float) -> None:
        """The audit found the rank's engine without a prefix the index credited in no doubt, for a
        request dispatched at ``since`` (monotonic): the rank routes cold here and on every sibling
        until its engine's events show what it lost."""
        self.kv.withholds.withhold(carrier, WithholdReason.FALSE_HIT, since)
        if self.notices is not None:
            age_ms = int(max(0.0, time.monotonic() - since) * 1000)
            self.notices.tell(KvNotice(NoticeKind.WITHHOLD_FALSE_HIT, (carrier,), age_ms))

    def doubtful(self, carrier: Carrier) -> bool:
        """A prediction for this rank is made in a known-doubtful state (the prediction audit labels it):
        its bootstrap is not settled (holding, or proving a graft's watermark), or the KV plane says so."""
        boot = self.bootstrap.ranks.get(carrier)
        return (boot is not None and boot.state is not RankState.SETTLED) or self.kv.doubtful(carrier)

    def blocker(self) -> Cause | None:
        """What keeps this replica from routing at all, in words that say where to look."""
        w = self.engine_watcher
        for watcher in (w, self.prefill_watcher):
            if watcher is not None and watcher.workers is None:
                why = f"engine discovery not synced ({watcher.last_error or 'listing'})"
                return Cause(CauseCode.ENGINE_DISCOVERY, why)
        if not self.targets.urls:
            where = ""
            if w is not None:
                where = f": none ready in the {w.what()}"
            return Cause(CauseCode.NO_ENGINES, f"no engines discovered{where}")
        return None

    def drain(self) -> Drain:
        """Shutting down: not Ready from now on, and every response closes its connection, so clients
        move off before the server stops listening (cli.py waits out the drain returned)."""
        if self.drained is None:
            p = self.config.proxy
            self.drained = Drain(p.shutdown_drain_s, max(p.shutdown_drain_s, p.shutdown_drain_max_s))
        return self.drained

    @property
    def draining(self) -> bool:
        return self.drained is not None

    def picked(self) -> None:
        """A gateway opened a pick stream (counted while draining: the gateway has not moved off yet)."""
        if self.drained is not None:
            self.drained.pick()

    @web.middleware
    async def _arrivals(self, request: web.Request, handler) -> web.StreamResponse:
        # a client that has not moved off yet (a probe is no client: the kubelet probes till the end)
        if self.drained is not None and request.path not in PROBES:
            self.drained.request()
        return await handler(request)

    def ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "shutting down"
        if (cause := self.blocker()) is not None:
            return False, cause.message
        if not self.targets.candidates():
            return False, "no healthy engine"
        if self.policy.needs_tokens and any(w.kv for w in self.kv.workers.values()) and not self.kv.live():
            return False, "no live KV event subscription"
        return self.bootstrap.readiness()

    def index_summary(self) -> dict:
        """Per carrier and tier: how many blocks the index holds and a digest of their engine hashes."""
        index = self.kv.index
        states = self.kv.carrier_states()
        carriers = []
        for c in index.carriers:
            by_tier = index.carrier_engine_hashes(c)
            carriers.append(
                {
                    "engine": c.engine,
                    "rank": c.rank,
                    # disconnected: held for re-adoption, invisible to routing and export
                    "state": states.get(c.engine, "ok"),
                    "tiers": {
                        t.name.lower(): {"blocks": len(by_tier[t]), "digest": hash_set_digest(by_tier[t])}
                        for t in TIER_ORDER
                    },
                }
            )
        subs = [
            {"engine": s.carrier.engine, "rank": s.carrier.rank, "connected": s.connected, "cursor": s.cursor}
            for s in self.kv.subscriptions()
        ]
        return {"nodes": index.node_count(), "carriers": carriers, "subscriptions": subs}

    # ---- HTTP ----------------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        # aiohttp refuses a body of client_max_size or more; the proxy answers 413 itself above the limit.
        app = web.Application(
            client_max_size=self.config.proxy.max_body_bytes + 1, middlewares=[self._arrivals, openai_errors]
        )
        app.router.add_post("/v1/completions", self.proxy.completions)
        app.router.add_post("/v1/chat/completions", self.proxy.chat_completions)
        app.router.add_get("/v1/models", self.proxy.models)
        app.router.add_post("/v1/responses", self.proxy.responses_create)
        for rest, methods in RESPONSE_ITEM.items():
            item = "/v1/responses/{response_id}" + rest
            for method in methods:
                if method == "GET":
                    app.router.add_get(item, self.proxy.response_item)  # and HEAD
                else:
                    app.router.add_route(method, item, self.proxy.response_item)
        app.router.add_post("/v1/messages", self.proxy.messages)
        app.router.add_post("/generate", self.proxy.generate)
        app.router.add_post("/inference/v1/generate", self.proxy.token_generate)
        for path in FORWARDED:
            app.router.add_post(path, self.proxy.by_load)
        for path in self.config.proxy.allow_paths:
            app.router.add_route("*", path, self.proxy.by_load)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        if self.config.metrics.public:
            self._add_metrics_routes(app)
        else:  # say where they went, to whoever scraped them here before
            for path in METRICS_PAGES:
                app.router.add_get(path, self._elsewhere)
        app.on_response_prepare.append(self._close_if_draining)
        return app

    def build_metrics_app(self) -> web.Application:
        """The metrics port's app: what Prometheus and operators read, never a client (docs/security.md)."""
        app = web.Application(middlewares=[openai_errors])
        self._add_metrics_routes(app)
        return app

    def _add_metrics_routes(self, app: web.Application) -> None:
        for path, handler in zip(METRICS_PAGES, (self._metrics, self._index, self._load), strict=True):
            app.router.add_get(path, handler)

    async def _elsewhere(self, request: web.Request) -> web.Response:
        where = "on the metrics port (--metrics-port), not the public one"
        return ProxyError(404, f"{request.path} is served {where}", code="not_found").response()

    async def _close_if_draining(self, _request: web.Request, response: web.StreamResponse) -> None:
        # A keep-alive connection closed by the server while a client sends on it loses that request
        # (the client sees a disconnect before any answer): while draining, each response says
        # Connection: close instead, so no connection is left idle for the final close to catch. The
        # header by hand: aiohttp has composed its own headers before this hook runs.
        if self.draining:
            response.force_close()
            response.headers["Connection"] = "close"

    async def _healthz(self, _req: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def _refresh_fleet_gauges(self) -> None:
        g = self.fleet_metrics
        g.peers_fresh.set(self.fleet.fresh_peers())
        totals: dict[tuple[str, str], float] = {}
        for row in self.fleet.summary()["targets"]:
            for source, value in (("fleet", row["load"]), ("own", row["own"]), ("peers", row["peers"])):
                totals[row["engine"], source] = totals.get((row["engine"], source), 0) + value
            for source in ("unseen", "discounted"):
                k = (row["engine"], source)
                totals[k] = totals.get(k, 0) + row[source]
        g.load.clear()
        for (engine, source), value in totals.items():
            g.load.labels(engine, source).set(value)

    def probed_ready(self) -> tuple[bool, str]:
        """``ready()`` as a probe asks it (``/readyz``, the picker's gRPC health): once ready, a serving
        replica never leaves the Service over bootstrap."""
        ok, why = self.ready()
        if ok:
            self.bootstrap.latch_ready()
        return ok, why

    async def _readyz(self, _req: web.Request) -> web.Response:
        ok, why = self.probed_ready()
        return web.json_response({"ready": ok, "reason": why}, status=200 if ok else 503)

    async def _metrics(self, _req: web.Request) -> web.Response:
        self.kv.live()  # refresh the live-subscription gauge
        self.bootstrap.publish_misfits()  # and the configuration-mismatch one
        states = list(self.health.states().values())
        for state in BreakerState:
            self.metrics.engines.labels(state).set(states.count(state))
        self._refresh_fleet_gauges()
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _index(self, _req: web.Request) -> web.Response:
        return web.json_response(self.index_summary())

    async def _load(self, _req: web.Request) -> web.Response:
        return web.json_response(self.fleet.summary())


NOTICE_TRANSIT_S = 0.05


@contextlib.asynccontextmanager
async def run_router(
    config: RouterConfig, *, policy: Profile | None = None, tokenizer: Tokenizer | None = None
) -> AsyncIterator[tuple[Router, str]]:
    """Start a router in this event loop; yields it and its base URL. For tests, the demo and benches.
    ``policy`` and ``tokenizer`` override the config's (tests)."""
    log_redaction.install()  # before any server starts: no request bytes in any log line
    router = Router(config, policy=policy, tokenizer=tokenizer)
    # handler_cancellation: a client that disconnects cancels its handler, which closes the upstream
    # request, so the engine stops working for nobody. shutdown_timeout: what requests still in flight
    # get at the stop before they are cut (cli.py drains first).
    bounds = {"access_log": None, "shutdown_timeout": config.proxy.shutdown_timeout_s}
    runner = GuardedRunner(router.build_app(), config.server, handler_cancellation=True, **bounds)
    metrics = GuardedRunner(router.build_metrics_app(), config.server, **bounds)
    internal = None
    if router.token is not None:
        internal = GuardedRunner(
            internal_app(
                router.token,
                router.bootstrap,
                router.producer,
                router.accept_load_report,
                notice=router.accept_notice,
                flush=router.flush_cache,
            ),
            config.server,
            **bounds,
        )
    epp = epp_health = None
    try:
        await router.start()
        gateway = config.gateway
        if gateway.port is not None:
            picker = EndpointPicker(
                router.scheduler,
                config.proxy,
                targets=router.targets,
                load=router.load,
                hooks=router.proxy.hooks,
                health=router.health,
                fallbacks=gateway.fallbacks,
                bodies=router.proxy.bodies,
                tracer=router.tracer,
                conformance_test=gateway.conformance_test,
                arrived=router.picked,
                prefill=router.proxy.prefill,
                strip_headers=router.sessions.strip,
            )
            epp_host = gateway.host or config.host
            tls = (
                None if gateway.plaintext else server_identity(epp_host, gateway.cert_file, gateway.key_file)
            )

            def ready() -> bool:
                return router.probed_ready()[0]

            # A message may carry a whole buffered body: the body cap plus room for headers.
            cap = config.proxy.max_body_bytes + (1 << 20)
            epp = await serve(
                picker.open,
                epp_host,
                gateway.port,
                ready,
                tls,
                connection_age_s=gateway.connection_age_s,
                max_message=cap,
                keepalive_s=gateway.keepalive_s,
            )
            router.epp_address = f"{epp_host}:{epp.port}"
            router.epp_server = epp
            if gateway.health_port is not None:
                epp_health = await serve_health(epp_host, gateway.health_port, ready)
                router.epp_health_address = f"{epp_host}:{epp_health.port}"
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        port = runner.addresses[0][1]
        await metrics.setup()
        metrics_host = config.metrics.host or config.host
        await web.TCPSite(metrics, metrics_host, config.metrics.port).start()
        router.metrics_url = f"http://{metrics_host}:{metrics.addresses[0][1]}"
        if internal is not None:
            await internal.setup()
            host = config.internal.host or config.host
            await web.TCPSite(internal, host, config.internal.port).start()
            router.internal_url = f"http://{host}:{internal.addresses[0][1]}"
        yield router, f"http://{config.host}:{port}"
    finally:
        try:  # the servers wait for their requests in flight at once, each bounded by shutdown_timeout
            await asyncio.gather(
                runner.cleanup(),
                metrics.cleanup(),
                *([internal.cleanup()] if internal is not None else []),
                *([epp.stop(config.proxy.shutdown_timeout_s)] if epp is not None else []),
                *([epp_health.stop(0)] if epp_health is not None else []),
            )
        finally:
            await router.stop()
