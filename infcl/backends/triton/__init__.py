"""The Triton backend's per-API objects (issue 44's layout; today only the top-k search's, :mod:`.topk`)."""
