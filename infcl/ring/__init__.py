"""The ring over ranks: layout (who holds what), communicator, and the one driver loop."""
