"""Backends: what runs the model rows under the one decoding loop (``pced.decoding.loop.Rows``), one
package each, declared to the registry of ``pced.backend`` (its protocol and the list).

``rows`` holds the default backend's rows (one preallocated KV buffer, explicit masks and
positions); ``ape_attention`` adds APE's merged attention to them; ``threads`` bounds the CPU
threads any engine may be given. Every other engine drives the same rule (``pced.decoding.rule``)
and produces the same ``pced.text.answers`` types.
"""
