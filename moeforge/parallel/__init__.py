"""Layer 9, running sharded artifacts: the world of ranks (torchrun's environment, or ranks this process starts
itself) and the rendezvous port. The sharding rules live with the model (``model/sharding.py``,
``model/rank_model.py``), the collectives with the ops (``ops/collectives/``), the sharded compile with the
compiler (``compile/sharded_compile.py``) and the rank-0 backend with the backends (``runtime/backends/sharded.py``).
"""
