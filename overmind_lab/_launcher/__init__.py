"""The kernelspec launcher: its own process, the warm kernel's stand-in where a frontend runs the
kernelspec's argv itself (VS Code, nbclient without provisioners). See ``stand_in``."""
