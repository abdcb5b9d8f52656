"""The embedded launcher behind `tradeloop up` (the command itself: `tradeloop.cmd_up`).

    runs        run identity: the run's id and directory, its lock, its up.json, what a resume may change
    endpoints   where the services are reached: their ports (bound here), the Redis, the API token, services.json
    supervisor  the service processes: start in order, restart with backoff, stop with grace
    progress    the loop's state read from the services and from Redis: the live table, the summary rows
    stopping    what a stop waits for and what an interrupted trainer saved, in words
    launch      `run_up`: one run from start to summary, joining the above
"""
