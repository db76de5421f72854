"""The losses' per-block steps for the one ring loop (:class:`infcl.ring.driver.RingLoss`)."""
