"""Models loaded on demand under a bound and switched fairly, for every entry point that
offers several: the server (``server.models_registry``) and the chat UI (``ui.models``).

``pool``     the loaded models (least recently used first), the leases on them, and the
             switcher that loads the model of the oldest waiting request
``waiters``  the requests waiting for a model, in arrival order
"""

from mlxvlm.model_pool.pool import (IDLE_SECONDS, MIN_LOADED_SECONDS, ClientLeft, Lease,
                                    LoadFailed, ModelPool, PoolClosed, PoolError,
                                    SwitchingFailed, TooManyWaiting)

__all__ = ["IDLE_SECONDS", "MIN_LOADED_SECONDS", "ClientLeft", "Lease", "LoadFailed",
           "ModelPool", "PoolClosed", "PoolError", "SwitchingFailed", "TooManyWaiting"]
