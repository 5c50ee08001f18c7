"""The engine-free routing core shared by the router and the simulator: instance state and load bookkeeping
(:mod:`dlmix.routing.state`), block hashing (:mod:`dlmix.routing.hashing`), the prefix indexes
(:mod:`dlmix.routing.prefix_index`) and the placement policies (:mod:`dlmix.routing.policies`). It imports no engine
and no front-end (router, simulator, launch, bench)."""
