"""The fake engine's configuration: one frozen dataclass shared by the CLI and the in-process helper."""

from __future__ import annotations

from dataclasses import dataclass

from router_runtime.kv.events import Dialect

# Port 0 means "pick free ports": for the ZMQ bases the publisher then finds dp_size *consecutive* free
# ports, so /server_info's base+rank contract still holds (see publisher.bind_port_range).
DEFAULT_KV_PORT = 5557
DEFAULT_REPLAY_PORT = 5657  # 100 above the PUB base so DP ranks never collide (vLLM leaves it to you)


class ConfigError(ValueError):
    """An invalid config field; ``field`` names it (the CLI maps it to its flag)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"invalid {field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class FakeEngineConfig:
    host: str = "127.0.0.1"  # HTTP and ZMQ bind host; "0.0.0.0" binds ZMQ on "*" (reported as "*")
    port: int = 0  # HTTP port; 0 = ephemeral
    kv_port: int = 0  # PUB base port (rank r binds kv_port + r); 0 = consecutive free ports
    replay_port: int = 0  # replay ROUTER base port; 0 = consecutive free ports
    dp_size: int = 1
    block_size: int = 16
    capacity_blocks: int = 4096  # device tier, per rank
    host_capacity_blocks: int = 0  # host tier, per rank; 0 = no host tier
    # A disk tier in a storage directory that outlives the process (and restart-as-new-incarnation),
    # with a storage identity marker; both or neither.
    storage_dir: str | None = None
    disk_capacity_blocks: int = 0  # disk tier, per rank; 0 = no disk tier
    dialect: Dialect = Dialect.VLLM_033
    # vLLM's default topic is the empty string, and an empty SUB subscription matches everything.
    topic: str = ""
    replay_buffer: int = 10_000  # batches kept per rank for replay, like vLLM's buffer_steps
    prefill_us_per_token: float = 20.0  # simulated prefill cost per *uncached* prompt token
    decode_tokens_per_s: float = 2000.0  # 0 = instant
    max_concurrency: int = 0  # requests running at once per engine; the rest queue; 0 = unlimited
    # A rank's prefills run one at a time and its decodes wait while one runs (compute.py); off: every
    # request computes alone.
    shared_compute: bool = False
    # LoRA adapters resident at once (vLLM's --max-loras; adapters.py); 0 = adapters cost nothing
    max_loras: int = 0
    lora_load_ms: float = 0.0  # loading an adapter that is not resident
    # Adapters served by name, as vLLM's --lora-modules: listed in /v1/models with their parent, and a
    # request whose model names one runs in its namespace (as with lora_name).
    lora_modules: tuple[str, ...] = ()
    model: str = "routerfleet/fake-model"
    cache_generated: bool = False  # also cache full blocks of prompt+output when a request finishes
    # A request's stored blocks are announced this long after its admission, as a real engine announces
    # them once computed (a long prefill: tens of ms); 0: at admission.
    publish_delay_ms: float = 0.0
    # A prefix-cache reset (/reset_prefix_cache, /flush_cache) announces its AllBlocksCleared only with
    # the rank's next step's batch, as vLLM does: until then, consumers hear nothing of it.
    lazy_clear: bool = False
    # vLLM's --kv-transfer-config (a KV connector, kv_role kv_both): a request's kv_transfer_params
    # make it a disaggregated prefill or decode leg (transfer.py); each block a decode leg takes from
    # the prefill engine costs this long.
    kv_transfer: bool = False
    transfer_us_per_block: float = 0.0
    # llm-d's routing sidecar in front of this (decode) engine, its vLLM flow: a completion or chat
    # request with ``x-prefiller-host-port`` is prefilled there first (transfer.py, ``sidecar_*``).
    pd_sidecar: bool = False
    # SGLang's --disaggregation-mode ("prefill", "decode"; "": neither): a request with a bootstrap room
    # is that leg (transfer.py); a decode leg waits at most room_timeout_s for its room.
    disaggregation_mode: str = ""
    room_timeout_s: float = 30.0
    # The engine's revision (model and KV layout, transfer.py): a decode leg prefilled by an engine of
    # another revision is refused, as a KV connector's handshake refuses it. "": any.
    revision: str = ""
    # prompt + max_tokens must fit, as vLLM refuses a request beyond its max_model_len (no allocation)
    max_model_len: int = 1 << 20

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field (the CLI turns it into an argparse error)."""
        checks = [
            ("port", 0 <= self.port <= 65535),
            ("kv_port", self.kv_port >= 0 and self.kv_port + self.dp_size - 1 <= 65535),
            ("replay_port", self.replay_port >= 0 and self.replay_port + self.dp_size - 1 <= 65535),
            ("dp_size", 1 <= self.dp_size <= 256),
            ("block_size", self.block_size >= 1),
            ("capacity_blocks", self.capacity_blocks >= 1),
            ("host_capacity_blocks", self.host_capacity_blocks >= 0),
            ("disk_capacity_blocks", self.disk_capacity_blocks >= 0),
            ("replay_buffer", self.replay_buffer >= 1),
            ("prefill_us_per_token", self.prefill_us_per_token >= 0),
            ("decode_tokens_per_s", self.decode_tokens_per_s >= 0),
            ("max_concurrency", self.max_concurrency >= 0),
            ("max_loras", self.max_loras >= 0),
            ("lora_load_ms", self.lora_load_ms >= 0),
            ("publish_delay_ms", self.publish_delay_ms >= 0),
            ("transfer_us_per_block", self.transfer_us_per_block >= 0),
            ("disaggregation_mode", self.disaggregation_mode in ("", "prefill", "decode")),
            ("room_timeout_s", self.room_timeout_s > 0),
            ("max_model_len", self.max_model_len >= 1),
            ("model", bool(self.model)),
        ]
        for name, ok in checks:
            if not ok:
                raise ConfigError(name, f"{getattr(self, name)!r} is out of range")
        if (self.disk_capacity_blocks > 0) != bool(self.storage_dir):
            raise ConfigError("disk_capacity_blocks", "a disk tier needs a storage dir, and vice versa")
        if self.kv_port and self.replay_port:
            kv = range(self.kv_port, self.kv_port + self.dp_size)
            replay = range(self.replay_port, self.replay_port + self.dp_size)
            if set(kv) & set(replay):
                raise ConfigError("replay_port", "its per-rank range overlaps the kv_port range")
            if self.port and (self.port in kv or self.port in replay):
                raise ConfigError("port", "it collides with a ZMQ port")

    @property
    def zmq_host(self) -> str:
        return "*" if self.host in ("0.0.0.0", "", "*", "::") else self.host
