"""The prediction debug headers, an operator's tool: what the decision credited the chosen engine with
(``X-RouterFleet-Predicted-Cached-Tokens``, its tiers, whether it was in doubt), answered only with
``--debug-prediction`` and only to a request whose ``X-RouterFleet-Debug-Prediction`` carries the fleet
token, and only on a 2xx answer: on any answer, to anyone, it would be an exact cache oracle (a 400 too,
which costs the engine nothing). docs/security.md."""

from __future__ import annotations

import hmac

from ..scheduling.hooks import Exchange, ResponseWatch
from .audit import Prediction
from .headers import DEBUG_PREDICTION_HEADER, DOUBTFUL_HEADER, PREDICTED_HEADER, PREDICTED_TIERS_HEADER


class DebugPrediction:
    """The request hook (present only when enabled: ``token`` is the fleet token)."""

    name = "debug_prediction"

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def pre_request(self, exchange: Exchange) -> ResponseWatch | None:
        if exchange.prediction is None or not self.asked(exchange.headers.get(DEBUG_PREDICTION_HEADER)):
            return None
        return _Headers(exchange.prediction)

    def asked(self, presented: str | None) -> bool:
        """The caller presented the fleet token as the header's value."""
        return presented is not None and hmac.compare_digest(
            presented.encode("utf-8", "surrogateescape"), self._token
        )


class _Headers(ResponseWatch):
    def __init__(self, prediction: Prediction) -> None:
        self.prediction = prediction

    def response_received(self, status: int, headers) -> None:
        if 200 <= status < 300:
            p = self.prediction
            headers[PREDICTED_HEADER] = str(p.tokens)
            headers[DOUBTFUL_HEADER] = "true" if p.doubtful else "false"
            headers[PREDICTED_TIERS_HEADER] = p.tier_header()
