"""Resource planning before a run: the real architecture built on the ``meta`` device, its memory per process
under each sharding strategy, whether it fits, the cheapest change that makes it fit, and the time of a step
(``trl-jagg plan``; docs/planning.md).

- :mod:`.architecture`: the pipeline's components and configs (shipped JSON per Hub id, or a local folder).
- :mod:`.inputs`: one backbone call's inputs per family.
- :mod:`.measure`: saved activations and FLOPs of a call, measured by running it.
- :mod:`.memory`: the per-process memory table under DDP, ZeRO-2, FSDP2 and ZeRO-3.
- :mod:`.settings`: what a plan reads from ``trl-jagg train``'s arguments.
- :mod:`.plan`: the plan, its verdict, fix and step time; :mod:`.report`: its text and JSON.
"""
