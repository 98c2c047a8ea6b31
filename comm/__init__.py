"""Process groups and collectives (DP x TP mesh, EP group, MoE token movement)."""
