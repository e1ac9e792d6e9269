"""Names shared by the CRD, the renderers and the rollout decision."""

from __future__ import annotations

import enum

GROUP = "routerfleet.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RouterFleet"
PLURAL = "routerfleets"
FIELD_MANAGER = "routerfleet-operator"

# Labels. The fleet label is the pods' selector (and the scale subresource's status.selector).
LABEL_FLEET = "routerfleet.io/fleet"
LABEL_REVISION = "routerfleet.io/revision"  # the pod template's hash: which revision a pod runs
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_COMPONENT = "app.kubernetes.io/component"
ROUTER_APP = "routerfleet-router"

# The readiness gate on every router pod; the operator sets it True once the pod's verdict passes,
# and never back (latching).
SEEDED = "routerfleet.io/seeded"

# User actions on the RouterFleet (annotations): any new value acts once (the handled value is kept
# in status, so an operator restart never repeats it).
ANNOTATION_RETRY = "routerfleet.io/retry"  # retry a paused or rolled-back rollout
ANNOTATION_RESTARTED_AT = "routerfleet.io/restartedAt"  # a rolling, seed-gated restart

# The router's ports inside the pod (fixed: the operator owns --port, --metrics-port, --internal-port
# and --epp-port).
HTTP_PORT = 8080
INTERNAL_PORT = 8081
METRICS_PORT = 9090  # /metrics and /debug/*, never on the public port
EPP_PORT = 9002  # the endpoint picker (Envoy ext_proc over gRPC), with spec.gateway only
GATEWAY_PORT = 8088  # the standalone gateway's Envoy, beside the router (spec.gateway.standalone)
HTTP_PORT_NAME = "http"
INTERNAL_PORT_NAME = "internal"
METRICS_PORT_NAME = "metrics"
EPP_PORT_NAME = "epp"
GATEWAY_PORT_NAME = "gateway"

# The Gateway API Inference Extension's InferencePool (spec.gateway renders one).
POOL_API_VERSION = "inference.networking.k8s.io/v1"
POOL_KIND = "InferencePool"

TOKEN_KEY = "token"
TOKEN_VOLUME = "internal-token"
TOKENIZER_VOLUME = "tokenizer"
SESSION_STORE_VOLUME = "session-store"
ENVOY_VOLUME = "envoy-config"
RESERVED_VOLUMES = (TOKEN_VOLUME, TOKENIZER_VOLUME, SESSION_STORE_VOLUME, ENVOY_VOLUME)
TOKEN_DIR = "/var/run/routerfleet/internal-token"
TOKENIZER_DIR = "/etc/routerfleet/tokenizer"
SESSION_STORE_DIR = "/var/run/routerfleet/session-store"  # the store's password, from its Secret
SESSION_STORE_KEY = "password"
ENVOY_DIR = "/etc/routerfleet/envoy"  # the standalone gateway's configuration, from its ConfigMap
ENVOY_KEY = "envoy.yaml"

# The router's /internal/bootstrap document.
BOOTSTRAP_API_VERSION = "routerfleet.io/bootstrap/v1"


class Verdict(enum.StrEnum):
    """A replica's bootstrap verdict, as its /internal/bootstrap reports it (router_runtime's
    ``bootstrap.state.Verdict``; a test keeps the two in step)."""

    PENDING = "pending"
    WARM = "warm"
    FROM_ORIGIN = "from_origin"  # rebuilt exactly from the engines' own replay buffer: warm
    WARM_UNWITNESSED = "warm_unwitnessed"
    NO_PEERS = "no_peers"
    FLEET_COLD = "fleet_cold"
    TIMED_OUT = "timed_out"
    DISABLED = "disabled"
    # The engines' stores do not fit the router's configuration (block size, KV cache group): never
    # in passVerdicts (the CRD's enum keeps it out), so it fails the seed whenever siblings serve.
    CONFIG_MISMATCH = "config_mismatch"


# Verdicts that mean "there was nothing to inherit": gating on them deadlocks a first deploy (an
# unready pod is out of its siblings' peer set, so no replica could ever find a warm one).
NEVER_GATE = frozenset({Verdict.NO_PEERS, Verdict.FLEET_COLD})
# Verdicts passVerdicts can never list (the CRD's enum leaves them out): not settled, or not warm
# whatever was inherited.
NEVER_PASS = frozenset({Verdict.PENDING, Verdict.CONFIG_MISMATCH})
DEFAULT_PASS_VERDICTS = frozenset(
    {
        Verdict.WARM,
        Verdict.FROM_ORIGIN,
        Verdict.WARM_UNWITNESSED,
        Verdict.NO_PEERS,
        Verdict.FLEET_COLD,
        Verdict.DISABLED,
    }
)


class OnSeedFailure(enum.StrEnum):
    PAUSE = "Pause"  # hold the failed pod and pause the rollout until a retry or a new spec
    ROLLBACK = "Rollback"  # restore the last completed revision's template
    PROCEED = "Proceed"  # admit the pod cold and report CacheWarm=False


class Phase(enum.StrEnum):
    PROGRESSING = "Progressing"
    COMPLETE = "Complete"
    PAUSED = "Paused"
    ROLLED_BACK = "RolledBack"


class PauseReason(enum.StrEnum):
    USER = "User"  # spec.paused
    SEED_FAILED = "SeedFailed"
    PEER_DISCOVERY_NOT_SYNCED = "PeerDiscoveryNotSynced"
    CONFIG_MISMATCH = "ConfigMismatch"


# The router flags the operator renders; extraArgs may not set them (nor any prefix argparse would
# expand to one of them). The CRD's CEL rule carries the same list (a test compares them).
OWNED_FLAGS = (
    "--port",
    "--metrics-host",
    "--metrics-port",
    "--worker",
    "--block-size",
    "--log-level",
    "--policy",
    "--tokenizer",
    "--k8s-selector",
    "--k8s-namespace",
    "--k8s-http-port",
    "--k8s-kv-port",
    "--k8s-replay-port",
    "--k8s-dp-size",
    "--k8s-topic",
    "--kubeconfig",
    "--internal-host",
    "--internal-port",
    "--internal-token-file",
    "--kv-peer",
    "--kv-peer-selector",
    "--kv-peer-port",
    "--no-kv-bootstrap",
    "--kv-bootstrap-timeout-ms",
    "--kv-bootstrap-seed-required",
    "--session-store",
    "--session-store-password-file",
    "--epp-host",
    "--epp-port",
    "--epp-plaintext",
    "--no-epp-plaintext",
    "--epp-pool",
    "--otlp-traces-endpoint",
    "--trace-sample-ratio",
    "--help",
)
# Flags the operator renders only for some specs, owned then (validate refuses them in extraArgs; the
# CRD cannot say it per spec): a disaggregated fleet's, and the standalone gateway's drain.
DISAGGREGATION_FLAGS = (
    "--k8s-role-label",
    "--k8s-prefill-selector",
    "--k8s-revision-label",
    "--pd-protocol",
    "--pd-threshold-tokens",
)
STANDALONE_FLAGS = ("--shutdown-drain-ms",)
RESERVED_ENV = ("POD_NAME", "POD_NAMESPACE", "POD_IP")


def owned_flag_in(arg: str, owned: tuple[str, ...] = OWNED_FLAGS) -> bool:
    """Whether one extraArgs item would set an ``owned`` flag: the CRD's CEL rule, in Python.
    argparse accepts any unique prefix of a long option, so "--internal-tok=x" sets
    --internal-token-file: an item is refused when its name (before "=") is a prefix of an owned flag.
    "--" (end of options) and "-h" are refused too."""
    if arg == "-h":
        return True
    if not arg.startswith("--"):
        return False
    name = arg.split("=", 1)[0]
    return any(flag.startswith(name) for flag in owned)
