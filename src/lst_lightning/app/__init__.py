"""The training app: the LightningModule, its callbacks and metrics, the Hydra
entry point ``lst-train`` and the report ``lst-compare``. The only part of the
package that imports Lightning, Hydra or W&B."""
