"""The files flaxlens writes and reads: isolated-call artifacts and intervention sets. Every
file is untrusted on load: validated before anything is imported, no code run that the
user did not allow, memory and time bounded."""
