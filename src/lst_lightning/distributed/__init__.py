"""What the processes of a run share, on torch.distributed: the process group and its
collectives (the one-process identity where there is no group), and the one fixed-size
exchange with its one fault scheme, used by the exact head's rows and the app's row-sparse
gradients alike. Imports torch only (docs/architecture.md).

- ``collectives.py``: ``ProcessGroup`` and ``bit_hash``;
- ``fixed_exchange.py``: ``FixedExchange`` and ``FirstFault``.
"""
