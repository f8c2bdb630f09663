"""The policy lab: routing policies on the emulator's engines under a virtual clock."""
