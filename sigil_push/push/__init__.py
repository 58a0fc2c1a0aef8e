"""Push providers: one sender per provider behind the small interface of `base`."""
