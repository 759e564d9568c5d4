"""What this server's speed is known to be: each CPU kind's record, the precision advice, the app's sweep, their tables."""
