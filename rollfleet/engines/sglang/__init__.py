"""The SGLang engine: one replica drives one SGLang HTTP server, launched or attached (``base_url``).

Where things are: :mod:`.wire` (SGLang's native request and response shapes, sampling-parameter
translation, error fields, load; pure), :mod:`.launch` (``sglang.launch_server`` command line and
devices), :mod:`.engine` (the engine: hooks into :class:`rollfleet.engines.http.HTTPEngine` and
SGLang's own routes). Supervision, the transport-error rule, the pause gate and the abort loop are
the shared ones of :mod:`rollfleet.engines.http`.
"""

from rollfleet.engines.sglang.engine import SGLangEngine
from rollfleet.engines.sglang.wire import normalize_finish_reason, translate_sampling_params

__all__ = ["SGLangEngine", "translate_sampling_params", "normalize_finish_reason"]
