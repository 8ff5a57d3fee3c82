"""rolloutlog inside TRL's ``AsyncGRPOTrainer`` (extra ``[trl]``; TRL 1.16).

```python
worker = RolloutlogWorker(store="sqlite:///runs/rl.db", train_dataset=ds,
                          processing_class=tok, reward_funcs=funcs, backend=backend,
                          args=args)
trainer = AsyncGRPOTrainer(model, funcs, args, train_dataset=ds, processing_class=tok,
                           rollout_worker=worker, weight_transfer=NoOpWeightTransfer(),
                           callbacks=[worker.callback])
```
See docs/integrations/trl.md.
"""

from .callback import RolloutlogCallback
from .checkpoint import CHECKPOINT_FILE, RolloutlogCheckpoint, read_checkpoint
from .errors import (
    CheckpointStateMissingError,
    LogMismatchError,
    TrlConfigError,
    TrlIntegrationError,
    UnsupportedTrlFeatureError,
    WorkerFailedError,
)
from .factory import STORE_FILE, bench_worker_factory, store_url
from .prompts import TrlPrompts
from .weights import (
    NcclWeightTransfer,
    NoOpWeightTransfer,
    RolloutlogWeightTransfer,
    nccl_vllm_backend,
)
from .worker import RolloutlogWorker

__all__ = [
    "CHECKPOINT_FILE",
    "STORE_FILE",
    "CheckpointStateMissingError",
    "LogMismatchError",
    "NcclWeightTransfer",
    "NoOpWeightTransfer",
    "RolloutlogCallback",
    "RolloutlogCheckpoint",
    "RolloutlogWeightTransfer",
    "RolloutlogWorker",
    "TrlConfigError",
    "TrlIntegrationError",
    "TrlPrompts",
    "UnsupportedTrlFeatureError",
    "WorkerFailedError",
    "bench_worker_factory",
    "nccl_vllm_backend",
    "read_checkpoint",
    "store_url",
]
