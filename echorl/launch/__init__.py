"""Launchers: start a whole swarm (broker, samplers, trainer) as processes.

`local` runs them on this machine (`echorl run`).
"""
