"""Each API's per-block steps for the one ring loop (:class:`infcl.ring.driver.RingLoss`) and the named
per-row tensors each phase moves, unpacked from the backends' packed rows (softmax.py: ``SoftmaxPartials`` /
``SoftmaxUpstream``, with masks ``MaskedPartials`` / ``MaskedUpstream``; sigmoid.py: ``SigmoidPartials`` /
``SigmoidUpstream``; distill.py: ``DistillPartials`` / ``DistillUpstream``; rank.py: the ranks' two passes on
``Best`` and ``Ahead``)."""
