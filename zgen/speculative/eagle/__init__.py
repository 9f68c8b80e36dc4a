"""EAGLE speculative decoding: a one-layer head drafts from the target's own features.

* :class:`EagleHead` — the head (:mod:`.head`): parameters and the pure draft step;
* :class:`Eagle` — the head as a speculator of the runtime's loop (:mod:`.speculator`);
  ``Eagle.load(DIR, model)`` reads a head ``zgen eagle train`` wrote (:mod:`.checkpoint`);
* :mod:`.train` — teacher-forced training on the target's features (``zgen eagle train``).
"""

from zgen.speculative.eagle.head import EagleHead
from zgen.speculative.eagle.speculator import Eagle

__all__ = ["Eagle", "EagleHead"]
