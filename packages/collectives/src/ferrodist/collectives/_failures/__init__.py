"""What a group does about failures: blame (``blame``: abort the group on every member and
name the culprit), the launcher's record of a rank's first error (``record``), and the
survivors' agreement on who is live, to shrink the group (``agreement``)."""
