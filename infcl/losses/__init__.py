"""The losses' per-block steps for the one ring loop (:class:`infcl.ring.driver.RingLoss`) and the named
per-row tensors each phase moves (softmax.py: ``SoftmaxPartials`` / ``SoftmaxUpstream``, with masks
``MaskedPartials`` / ``MaskedUpstream``; sigmoid.py: ``SigmoidPartials`` / ``SigmoidUpstream``)."""
