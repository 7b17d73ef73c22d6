"""The launchers of a job that spans several nodes, and how they keep each other informed.

Node 0's launcher (the *hub*) listens on ``--master-addr:--master-port``; the launcher of
every other node (a *member*) connects to it. Each connection starts with a challenge and
response over ``FERRODIST_TOKEN``, which every node must have (the same value): each side
proves it holds the token without sending it. Then:

1. **Join.** The hub runs every connection's handshake at once, each with its own limit
   (``HANDSHAKE``), so a connection that stays silent or is not a launcher holds up no
   other; a node that never arrives is named with what the hub refused, and from where.
   A member sends ``hello`` (its node rank, ``--nnodes``, ``-n``, host, pid).
   When every node has arrived the hub numbers the ranks node by node, picks the port of
   rank 0's store and a job id, and sends ``start`` with the list of nodes; a node that has
   not arrived by ``--join-timeout`` fails the job on every node that did, naming it.
   Conflicting starts (two launchers as one node, a different ``--nnodes``) end the job on
   every node that arrived, saying which.
2. **Run.** Every launcher sends a heartbeat every 0.5 s. A launcher whose ranks fail (or
   that is interrupted) tells the hub, which tells every node to stop its ranks. A member
   whose connection ends before it has reported, or that is silent for ``silence`` seconds,
   is lost: the hub stops every other node. A member that loses the hub stops its ranks.
   A launcher that was stopped (SIGSTOP) while the nodes meet says so when it wakes
   (``link.Watch``): node 0, woken past its join deadline, first lets the connections that waited
   in its queue finish their handshake (a short freeze costs the job nothing); a member
   waits for node 0's greeting until its own deadline, not just a handshake's. When the freeze
   outlasts the deadlines, every node's summary opens with the same words, "node K's launcher
   froze:", and names the same node.
3. **Verdict.** Every member sends how its ranks ended (``ends``); the hub blames one rank
   or node for the whole job (``judge``) and sends that ``verdict`` to every member, so
   every launcher prints the same summary and exits with the same code.

The ranks' own token is derived from ``FERRODIST_TOKEN`` and the job id (HMAC-SHA256), so
two jobs started with one exported token never accept each other's connections, and no
secret travels on the control channel.
"""
