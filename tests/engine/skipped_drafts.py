"""A scheduler watched for requests whose pending drafts a plan leaves out."""


def watch_skipped_drafts(scheduler) -> list[int]:
    """Wraps scheduler.schedule -> a list that gets, per plan, how many requests with pending
    drafts it left out."""
    skipped, schedule = [], scheduler.schedule

    def watching():
        waiting = set(scheduler.pending_drafts())
        plan = schedule()
        skipped.append(len(waiting - {e.req_id for e in plan.batch} if plan else waiting))
        return plan

    scheduler.schedule = watching
    return skipped
